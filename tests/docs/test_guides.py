"""guides/mixed_precision.py and guides/porting.py run and show what they say.

Each guide runs once, in a fresh interpreter (the porting guide configures
devices and imports kmp halfway, so it cannot share this process), with
`KMP_GUIDE_SMALL=1`. The tests then check the facts the prose states against
what the code printed, so a guide whose text drifts from kmp's or Keras's
behaviour fails here.
"""

import re

import pytest

from tests.support import scripts

# With -n: the scripts a module starts run once, on one worker.
pytestmark = pytest.mark.xdist_group("guides")

FOLDER = "guides"
SMALL = "KMP_GUIDE_SMALL"
MIXED_PRECISION = pytest.mark.parametrize("script", ["mixed_precision.py"])
PORTING = pytest.mark.parametrize("script", ["porting.py"])


# The first test of a guide waits for it (up to ~20 s: a fresh interpreter
# that imports TensorFlow and trains); each runs once for the module.
@pytest.fixture(scope="module", autouse=True)
def _start_guides(request):
    scripts.start_selected(request, FOLDER, SMALL)
    yield
    scripts.cancel_waiting()


@pytest.fixture
def out(script):
    """The stdout of the guide named by the test's `script` parameter."""
    return scripts.output_of(f"{FOLDER}/{script}", SMALL)


def number_after(text: str, label: str) -> float:
    match = re.search(re.escape(label) + r"\s*(\S+)", text)
    assert match, f"{label!r} not printed in:\n{text}"
    return float(match.group(1).rstrip(",").strip("[]"))


def losses(text: str, label: str):
    match = re.search(
        re.escape(label) + r"loss went from ([\d.]+) to ([\d.]+)", text
    )
    assert match, f"no '{label}loss went from' line in:\n{text}"
    return float(match.group(1)), float(match.group(2))


# --- guides/mixed_precision.py ----------------------------------------------


@MIXED_PRECISION
def test_mixed_precision_policies_and_dtypes(out):
    assert "mixed_float16: compute float16, variables float32" in out
    assert "mixed_bfloat16: compute bfloat16, variables float32" in out
    assert "kernel dtype: float32" in out
    assert "output dtype of a mixed_float16 layer: float16" in out
    assert "inside the scope: mixed_bfloat16" in out
    assert "pinned to float32: float32" in out
    assert "after the scope: float32" in out


@MIXED_PRECISION
def test_mixed_precision_ranges_are_computed(out):
    assert number_after(out, "float16  largest finite:") == 65504
    assert number_after(out, "float16  smallest normal:") == 6.104e-05
    assert number_after(out, "float16  smallest positive:") == 5.96e-08
    assert "float16  == 2**-24:         True" in out
    assert number_after(out, "bfloat16 largest finite:") == 3.39e38
    # 70000 overflows float16 and survives, rounded, in bfloat16; 1e-8
    # underflows float16; 1 + 1/256 is 1 in bfloat16.
    assert re.search(r"70000\s+inf\s+70144", out)
    assert re.search(r"1e-08\s+0\s+1.00\d+e-08", out)
    assert re.search(r"1.0039062\s+1.0039062\s+1\n", out)


@MIXED_PRECISION
def test_mixed_precision_model_output_is_float32_and_fit_learns(out):
    assert "activation: policy float32, computes in float32" in out
    assert "output dtype: float32" in out
    # The module moved with the restructuring (was kmp.optimizer).
    assert "optimizer: kmp.core.optimizer.LossScaleOptimizer" in out
    before, after = losses(out, "fit: ")
    assert after < before


@MIXED_PRECISION
def test_mixed_precision_loss_scaling_rescues_a_small_gradient(out):
    assert number_after(out, "gradient, float16, no scaling:") == 0.0
    scaled = number_after(out, "gradient, float16, scaled by 2**15:")
    assert abs(scaled - 1e-8) < 1e-10


@MIXED_PRECISION
def test_mixed_precision_dynamic_scale_walkthrough(out):
    rows = re.findall(
        r"scale\s+(\d+), counter (\d), iterations (\d), skipped (\d)", out
    )
    # Finite, overflow (skipped and halved), finite, finite (doubles).
    assert rows == [
        ("32768", "1", "1", "0"),
        ("16384", "0", "1", "1"),
        ("16384", "1", "2", "1"),
        ("32768", "0", "3", "1"),
    ]
    assert "[inf, 1.0]: scale 128, weight [0.9 0.9], skipped 1" in out


@MIXED_PRECISION
def test_mixed_precision_custom_loop_learns(out):
    assert re.search(r"custom loop: \d+ steps, \d+ skipped, scale \d+", out)
    before, after = losses(out, "custom loop: ")
    assert after < before


@MIXED_PRECISION
def test_mixed_precision_reports_the_hardware(out):
    assert re.search(r"GPUs visible: \d+", out)
    assert re.search(r"CPU has AVX-512 BF16: (True|False)", out)


# --- guides/porting.py -------------------------------------------------------


@PORTING
def test_porting_global_policy_is_per_thread_in_keras_process_wide_in_kmp(out):
    assert "Keras 3: main thread: mixed_float16" in out
    assert "Keras 3: new thread:  float32" in out
    assert "kmp: main thread: mixed_float16" in out
    assert "kmp: new thread:  mixed_float16" in out


@PORTING
def test_porting_saved_model_keeps_the_scale_only_with_kmp(out):
    keras_part, kmp_part = out.split("kmp: compile('adam')")
    keras_trained = number_after(keras_part, "LossScaleOptimizer, scale")
    assert keras_trained < 2**15  # The targets made the scale come down.
    assert "loaded as:    keras.src.optimizers.adam.Adam\n" in keras_part
    assert "Skipping variable loading for optimizer 'adam'" in keras_part
    trained = re.search(r"trained with: kmp\S+, scale (\d+)", kmp_part)
    loaded = re.search(r"loaded as: +kmp\S+, scale (\d+)", kmp_part)
    assert trained and loaded, kmp_part
    assert loaded.group(1) == trained.group(1) == str(int(keras_trained))


@PORTING
def test_porting_names_and_fixed_scale(out):
    assert 'global policy: <Policy "mixed_float16">' in out
    assert (
        "kmp properties: loss_scale 1024.0 dynamic_counter 0 dynamic True "
        "initial_scale 1024.0 dynamic_growth_steps 100 inner_optimizer SGD"
    ) in out
    assert "dynamic_counter / get_scaled_loss: False False False" in out
    assert "dynamic_scale 1024.0 step_counter 0" in out
    assert "no longer supports `dynamic=False`" in out
    assert "loss_scale_factor=128, after an inf step: [-inf  0.9]" in out
    assert "initial_scale=128, after an inf step: [1. 1.] skipped: 1" in out


@PORTING
def test_porting_both_custom_loop_recipes_agree(out):
    steps = re.findall(r"recipe *: weights after one step (.*)", out)
    assert steps == ["[ 0.4 -1.6]"] * 3


@PORTING
def test_porting_skipped_step_leaves_iterations(out):
    assert "Keras 3: iterations after 1 finite and 1 skipped step: 1" in out
    assert "kmp: iterations after 1 finite and 1 skipped step: 1" in out
    assert "kmp: skipped_steps: 1" in out


@PORTING
def test_porting_scale_bounds(out):
    assert "Keras 3: scale after 200 NaN steps: 0\n" in out
    assert "Keras 3: weights after the next, healthy step: [nan nan]" in out
    assert "kmp: scale after 200 NaN steps: 1\n" in out
    assert "kmp: weights after the next, healthy step: [0.8 0.8]" in out
    assert "Keras 3: scale after 1, 2, 3 growth steps: 1.701e+38, inf" in out
    assert (
        "kmp: scale after 1, 2, 3 growth steps: 1.701e+38, 1.701e+38, 1.701e+38"
    ) in out


@PORTING
def test_porting_distributed_skip_is_decided_after_aggregation(out):
    assert "Keras 3: weight after a step with an inf on replica 1: [-inf" in out
    assert "kmp: weight after a step with an inf on replica 1: [1. 1.]" in out


@PORTING
def test_porting_fused_adam_is_one_kernel(out):
    keras_line = re.search(r"Keras 3 Adam: (\d+) ops: (.*)", out)
    fused_line = re.search(r"kmp.FusedAdam: (\d+) op: (.*)", out)
    assert keras_line and fused_line, out
    assert int(keras_line.group(1)) >= 10
    assert "ResourceApplyAdam" not in keras_line.group(2)
    assert fused_line.group(2) == "ResourceApplyAdam"


@PORTING
def test_porting_deepspeed_config_maps_onto_kmp(out):
    assert (
        "kmp from DeepSpeed fp16: initial_scale 65536, dynamic_growth_steps "
        "4, hysteresis 2, min_scale 1, growth_factor 2, backoff_factor 0.5"
    ) in out


@PORTING
def test_porting_deepspeed_scale_trajectory_matches_kmp(out):
    rows = re.findall(
        r"^ *(\d+) +(ok|inf) +(\d+) +(\d+) +(\d+)$", out, re.MULTILINE
    )
    assert len(rows) == 38, out
    assert [int(step) for step, *_ in rows] == list(range(38))
    for step, _, deepspeed, kmp_scale, _ in rows:
        assert deepspeed == kmp_scale, f"step {step}"
    scales = [int(kmp_scale) for *_, kmp_scale, _ in rows]
    # The script grows, tolerates an overflow (hysteresis 2), backs off.
    assert scales[3] == 2**17 and scales[4] == 2**17 and scales[8] == 2**16
    assert min(scales) == 2**14
    assert "DeepSpeed (to 0.17.0) and kmp agree at every step: True" in out
    assert "DeepSpeed 0.17.1 and later first differ at step 3:" in out
    newer = [int(row[4]) for row in rows]
    assert newer[3] == 2**16 and newer[4] == 2**16


@PORTING
def test_porting_deepspeed_stops_at_the_floor_kmp_skips(out):
    assert (
        "DeepSpeed, an overflow at min_loss_scale: overflow with the loss "
        "scale at min_loss_scale: DeepSpeed stops the run"
    ) in out
    assert "kmp, an overflow at min_scale: skipped 1 step, scale 1.0" in out


# --- guides/watching_the_scale.py --------------------------------------------

WATCHING = pytest.mark.parametrize("script", ["watching_the_scale.py"])


def log2_scales(text: str, name: str):
    match = re.search(
        re.escape(name) + r": log2\(scale\) per batch:\n(.*)", text
    )
    assert match, f"no {name!r} run in:\n{text}"
    return [float(value) for value in match.group(1).split()]


@WATCHING
def test_watching_sawtooth_grows_then_backs_off_around_a_level(out):
    scales = log2_scales(out, "sawtooth")
    assert len(scales) == 40
    assert scales[:4] == [10, 11, 11, 12]  # Doubles every 2 steps.
    first_drop = next(i for i in range(1, 40) if scales[i] < scales[i - 1])
    level = scales[first_drop - 1]
    # After the first overflow it stays within a few halvings of the level.
    assert all(level - 4 <= s <= level + 2 for s in scales[first_drop:])
    assert re.search(r"sawtooth: .*\n.*\n  skipped ([1-9]\d*) of 40", out)


@WATCHING
def test_watching_floor_and_its_cure(out):
    scales = log2_scales(out, "floor")
    assert scales[:10] == list(range(9, -1, -1))
    assert scales[10:] == [0] * 30
    assert (
        "skipped 40 of 40 batches; epoch: loss_scale 1, skipped_steps 40, "
        "consecutive_skips 40"
    ) in out
    assert log2_scales(out, "first layer in float32") == [10] * 40


@WATCHING
def test_watching_growth_without_bound_and_capped(out):
    growing = log2_scales(out, "growing")
    assert growing == [4] + [5 + i // 2 for i in range(39)]
    capped = log2_scales(out, "capped at max_scale=2**14")
    assert capped == [min(s, 14) for s in growing]
    assert "epoch: loss_scale 16384, skipped_steps 0" in out
    assert (
        "event files under: ['capped', 'floor', 'floor_fixed', 'growing', "
        "'sawtooth']"
    ) in out
