"""The first, structural stage of the kernel templates under ``templates/``.

A kernel's source is a Jinja file rendered twice. This stage picks its structure (which loops, which running state,
which block-skipping tests, the operands' batch offsets) with its own delimiters, ``[[ ]]`` and ``[% %]``, so that
Inductor's ``{{ }}`` pass through untouched; Inductor's TritonTemplate renders those second (sizes, strides, the
user's chain at the modification sites, the store). Python never edits a kernel's text: what varies is a template
variable or macro argument. A size or stride inside an expression is written ``[[ size_of("Q", -2) ]]``, which
gives Inductor's ``{{size("Q", -2)}}`` in parentheses.
"""

from __future__ import annotations

import pathlib
from typing import Any

import jinja2

TEMPLATES = pathlib.Path(__file__).parent / "templates"

STRUCTURE = jinja2.Environment(
    loader=jinja2.FileSystemLoader(TEMPLATES),
    block_start_string="[%",
    block_end_string="%]",
    variable_start_string="[[",
    variable_end_string="]]",
    comment_start_string="{#",
    comment_end_string="#}",
    keep_trailing_newline=True,
    undefined=jinja2.StrictUndefined,
)


def size_of(name: str, dim: int) -> str:
    """Inductor's ``{{size(name, dim)}}`` for the second stage, in parentheses: a symbolic size prints as a product or
    a sum (``ks4*ks5``, ``ks0 + 1``), which an expression around it must not split."""
    return f'({{{{size("{name}", {dim})}}}})'


def stride_of(name: str, dim: int) -> str:
    """Inductor's ``{{stride(name, dim)}}``, in parentheses as ``size_of``'s."""
    return f'({{{{stride("{name}", {dim})}}}})'


STRUCTURE.globals.update(size_of=size_of, stride_of=stride_of)


def render(template: str, **values: Any) -> str:
    """The kernel source of ``templates/<template>`` with the given structure, for Inductor's TritonTemplate."""
    return STRUCTURE.get_template(template).render(**values)
