"""Rescale the running sums only when a row's max has grown by more than RESCALE_SLACK.

The online softmax multiplies the accumulator by alpha = 2^(m_old - m_new) on every column tile: one multiply per
accumulator element, as many per tile as there are logits at head dim 64, twice as many at 128. After the first
tiles the row max rarely grows. Taking the probabilities against a stale max instead (at most 2^RESCALE_SLACK, far
from fp16/bf16/fp32 overflow) changes nothing the final normalisation does not cancel; the tile rescales only when
some row of it needs a new max, a test the whole tile takes together.
"""

from __future__ import annotations

import re
from typing import Optional

RESCALE_SLACK = 8.0

_RUNNING_MAX_AND_P = re.compile(
    r'^(?P<lead> *)m_new(?P<h>\d*) = tl\.maximum\(m_i(?P=h), tl\.max\(logits(?P=h), 1\) \* LOGIT_SCALE\)\n'
    r'(?P=lead)m_shift(?P=h) = tl\.where\(m_new(?P=h) == float\("-inf"\), 0\.0, m_new(?P=h)\).*\n'
    r'(?P=lead)alpha(?P=h) = tl\.exp2\(m_i(?P=h) - m_shift(?P=h)\)\n'
    r'(?P=lead)(?P<p>p(?P=h) = tl\.exp2\(logits(?P=h) \* LOGIT_SCALE - m_shift(?P=h)\[:, None\]\).*)$', re.M)

_LAZY = """{lead}m_tile{h} = tl.max(logits{h}, 1) * LOGIT_SCALE
{lead}if tl.max((m_tile{h} > m_i{h} + {slack}).to(tl.int32), 0) > 0:  # some row's max grew: rescale the tile's rows
{lead}    m_new{h} = tl.maximum(m_i{h}, m_tile{h})
{lead}    alpha{h} = tl.exp2(m_i{h} - tl.where(m_new{h} == float("-inf"), 0.0, m_new{h}))
{lead}    l_i{h} = l_i{h} * alpha{h}
{lead}    acc{h} = acc{h} * alpha{h}[:, None]
{lead}    m_i{h} = m_new{h}
{lead}m_shift{h} = tl.where(m_i{h} == float("-inf"), 0.0, m_i{h})  # rows masked so far: keep exp2 finite
{lead}{p}"""


def with_lazy_rescale(source: str) -> Optional[str]:
    """``source`` with every running-max update lazy, or None where the kernel keeps other state that alpha
    rescales (a pair reduction) or runs in the logits' own units (``RUNNING_MAX_AND_P_WIDE``)."""
    if "pair_acc" in source or "row_scale" in source:
        return None
    lazy = re.sub(r"^ *m_i(\d*) = m_new\1\n", "", source, flags=re.M)  # the lazy block sets m_i itself
    lazy, blocks = _RUNNING_MAX_AND_P.subn(lambda found: _LAZY.format(slack=RESCALE_SLACK, **found.groupdict()), lazy)
    lazy = re.sub(r"l_i(\d*) = l_i\1 \* alpha\1 \+ tl\.sum\(p\1, 1\)", r"l_i\1 = l_i\1 + tl.sum(p\1, 1)", lazy)
    lazy = re.sub(r"tl\.dot\(p(\d*), v, acc\1 \* alpha\1\[:, None\]", r"tl.dot(p\1, v, acc\1", lazy)
    # Each lazy block uses alpha three times (its definition and two rescales); any other use is state left behind.
    if not blocks or len(re.findall(r"\balpha\d*\b", re.sub(r"#.*", "", lazy))) != 3 * blocks:
        return None
    return lazy
