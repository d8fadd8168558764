"""Differential testing: random attention programs, compiled through the overlay, against float64 eager.

The CI tier runs the pinned regression seeds and one fixed batch of seeds; the full tier (``--full``) runs
``FLASHLIGHT_RANDOM_PROGRAMS`` seeds (240 by default); the long run (`python -m benchmarks.random_programs --count
10000`) is recorded in docs/testing.md. Every seed that ever failed is pinned in REGRESSIONS.
"""

import os

import pytest

from benchmarks import random_programs

# seed -> (the fields it was drawn with when it failed, beyond those its seed draws now; what it found)
BEFORE_COMBINED = {"combined": "none", "scale_v": False, "read_positions": "none", "keep_rows": "random"}
REGRESSIONS = {
    34: ({"positions": "separate", **BEFORE_COMBINED},
         "size-1 batch dims made a constant position that Inductor shaped like the template's x range (fault)"),
    100075: ({"positions": "one_arange", **BEFORE_COMBINED},
             "a window built from one arange read as |n - n|: its mask dropped from every tile (the code before ad41820)"),
    100007: ({"scale_v": True, "read_positions": "none", "keep_rows": "random", "baddbmm": False}, "a constant factor on V was taken off V and applied nowhere (output off by that factor)"),
    660119: ({"frozen": "none"}, "a routed attention's k computed in a transposed order (scaled): laid out by Inductor in "
                                 "another, the branches' input check raised"),
    660178: ({"frozen": "none"}, "the same, in bf16 under the arange route's iota branch"),
    660285: ({"frozen": "none"}, "the same for q scaled in the [B, S, H, D] layout"),
}
# The same for programs drawn in training (q, k, v require grad; gradients checked).
TRAINING_REGRESSIONS = {
    270163: ({"keep_rows": "random", "frozen": "none"},
             "the joint graph reached the training pass out of topological order (an upstream replacement is "
             "sorted only after the custom pass): the fault wrapper's copy of it raised and the compile failed"),
}
# The same, compiled with every size symbolic (``torch.compile(dynamic=True)``; ``random_programs --dynamic``):
# seed -> (training, what it found).
DYNAMIC_REGRESSIONS = {
    410122: (False, "a symbolic product of sizes in a K/V batch offset printed unparenthesised after `%`: the heads of "
                    "K/V repeated over query groups read from the wrong batch entry (wrong values)"),
    410443: (False, "a head combination over a symbolic number of heads compared a SymBool as a number (fault)"),
    400708: (True, "a learned mask's per-logit gradient indexed its partial by symbolic batch sizes written into the "
                   "kernel as names it does not have (the compile raised)"),
    470310: (False, "a table offset by a size the symbolic graph specialised: Inductor printed the integer as "
                    "tl.full([XBLOCK], 16) in the chain, a name the attention kernel did not define (it raised at "
                    "run time, on the CPU harness, past the fallback)"),
}
# Captured tensors that meet before the scores (``random_programs.COMBINED``): one seed of each form, pinned, each of
# which must fuse. The window view (Swin's mask on a view of the scores that splits the batch dim) was declined until
# batch views lifted through a gathered per-head bias onto a view of the matmul.
COMBINED_SEEDS = {"bias_plus_mask": 100026, "gathered_plus_mask": 200102, "indexed_plus_region_mask": 200009,
                  "window_view": 100002}
CI_COUNT = int(os.environ.get("FLASHLIGHT_RANDOM_PROGRAMS", "240"))
BATCH = 40


@pytest.mark.parametrize("seed", sorted(REGRESSIONS))
def test_regression_seeds(seed):
    program = random_programs.draw(seed, **REGRESSIONS[seed][0])
    ok, _, detail = random_programs.check(program)
    assert ok, f"{program.describe()}: {detail}"


@pytest.mark.parametrize("seed", sorted(TRAINING_REGRESSIONS))
def test_training_regression_seeds(seed):
    program = random_programs.draw(seed, **TRAINING_REGRESSIONS[seed][0])
    ok, _, detail = random_programs.check(program, training=True)
    assert ok, f"{program.describe()}: {detail}"


@pytest.mark.parametrize("seed", sorted(DYNAMIC_REGRESSIONS))
def test_dynamic_regression_seeds(seed):
    program = random_programs.draw(seed, keep_rows="random", frozen="none")
    ok, _, detail = random_programs.check(program, training=DYNAMIC_REGRESSIONS[seed][0], dynamic=True)
    assert ok, f"{program.describe()}: {detail}"


@pytest.mark.parametrize("form,seed", sorted(COMBINED_SEEDS.items()))
def test_captured_tensors_combined_before_the_scores_fuse(form, seed):
    program = random_programs.draw(seed)
    assert program.combined == form
    ok, fused, detail = random_programs.check(program)
    assert ok and fused, f"{program.describe()}: fused={fused} {detail}"


# The first batch runs in the CI tier, the others in the full tier.
@pytest.mark.parametrize("start", [
    pytest.param(start, marks=[pytest.mark.full] if start >= 100_000 + BATCH else [])
    for start in range(100_000, 100_000 + max(CI_COUNT, BATCH), BATCH)
])
def test_random_programs_match_eager(start):
    failures, fused = [], 0
    for seed in range(start, start + BATCH):
        program = random_programs.draw(seed)
        ok, was_fused, detail = random_programs.check(program)
        fused += was_fused
        if not ok:
            failures.append(f"{program.describe()}: {detail}")
    assert not failures, "\n".join(failures)
    assert fused >= BATCH // 2, f"only {fused} of {BATCH} programs fused: the generator no longer exercises the overlay"


# Training: the same generator, with q, k and v requiring grad; gradients are compared too. A program the fused
# backward does not take (a pair reduction, a head combination, a single row) trains on
# upstream's path and must still match: about a quarter of the draws fuse for training.
TRAINING_BATCH = 6


@pytest.mark.parametrize("start", [
    pytest.param(start, marks=[] if start == 200_000 else [pytest.mark.full])
    for start in range(200_000, 200_000 + 6 * TRAINING_BATCH, TRAINING_BATCH)
])
def test_random_programs_train_and_match_eager(start):
    failures, fused = [], 0
    for seed in range(start, start + TRAINING_BATCH):
        program = random_programs.draw(seed)
        ok, was_fused, detail = random_programs.check(program, training=True)
        fused += was_fused
        if not ok:
            failures.append(f"{program.describe()}: {detail}")
    assert not failures, "\n".join(failures)
    assert fused >= 1, f"none of {TRAINING_BATCH} programs fused for training: the generator no longer exercises it"


# Training programs under the checked routes, called three times with the same tensors: consecutive positions made
# outside the program with k frozen (the arange route; its iota copy runs from the second call on the CPU), and a
# boolean mask tensor that is not causal (the causal route; its check answers False, the copy that reads it runs).
ROUTED_TRAINING_SEEDS = {680003: "arange", 680008: "causal"}


@pytest.mark.parametrize("seed", sorted(ROUTED_TRAINING_SEEDS))
def test_training_programs_under_the_checked_routes_match_eager(seed):
    program = random_programs.draw(seed)
    ok, fused, detail = random_programs.check(program, training=True)
    assert ok and fused, f"{program.describe()}: {detail}"
    assert f"({ROUTED_TRAINING_SEEDS[seed]} route)" in detail
