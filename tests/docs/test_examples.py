"""Every script in examples/ runs and does what its docstring promises.

Each example runs once, in a fresh interpreter (distributed.py splits the CPU
before TensorFlow starts, which this process has already done), with
`KMP_EXAMPLE_SMALL=1` so that it finishes in seconds. The tests check what it
printed: the dtypes, the loss scales, and that training lowered the loss.
"""

import math
import re

import pytest

from tests.support import scripts

# With -n: the scripts a module starts run once, on one worker.
pytestmark = pytest.mark.xdist_group("examples")

FOLDER = "examples"
SMALL = "KMP_EXAMPLE_SMALL"


@pytest.fixture(scope="module", autouse=True)
def _start_examples(request):
    scripts.start_selected(request, FOLDER, SMALL)
    yield
    scripts.cancel_waiting()


@pytest.fixture
def out(script):
    """The stdout of the example named by the test's `script` parameter."""
    return scripts.output_of(f"{FOLDER}/{script}", SMALL)


def went_from(text: str, what: str):
    """All `<what> went from X to Y` pairs printed, as floats."""
    pairs = re.findall(
        re.escape(what) + r" went from ([\d.]+) to ([\d.]+)", text
    )
    assert pairs, f"no '{what} went from' line in:\n{text}"
    return [(float(x), float(y)) for x, y in pairs]


def test_every_example_is_tested():
    tested = {
        "custom_loop_float16.py",
        "distributed.py",
        "fine_tune.py",
        "fit_bfloat16.py",
        "fixed_loss_scale.py",
        "gan.py",
    }
    shared = {"digits.py"}  # The data and model the examples import.
    # Run by tests/core/test_jax_and_torch.py,
    # tests/core/jax/test_multiprocess.py and
    # tests/core/torch/test_distributed.py, on their backends.
    other_backends = {
        "jax_custom_loop.py",
        "jax_multiprocess.py",
        "torch_custom_loop.py",
        "torch_ddp.py",
    }
    assert {
        path.name for path in (scripts.ROOT / FOLDER).glob("*.py")
    } == tested | shared | other_backends


@pytest.mark.parametrize("script", ["fit_bfloat16.py"])
def test_fit_bfloat16(out):
    assert "policy: mixed_bfloat16" in out
    assert "hidden layers compute in: bfloat16" in out
    assert "kernel dtype: float32" in out
    assert "output dtype: float32" in out
    # bfloat16 needs no loss scaling, so compile keeps the plain optimizer.
    assert "optimizer: Adam" in out
    ((before, after),) = went_from(out, "loss")
    assert after < before
    ((accuracy_before, accuracy_after),) = went_from(out, "accuracy")
    assert accuracy_after > accuracy_before


@pytest.mark.parametrize("script", ["custom_loop_float16.py"])
def test_custom_loop_float16_with_clipping(out):
    assert "policy: mixed_float16" in out
    assert "output dtype: float32" in out
    norms = [float(n) for n in re.findall(r"gradient norm ([\d.]+)", out)]
    assert norms and all(math.isfinite(n) for n in norms)
    steps = re.search(
        r"steps: (\d+) applied, (\d+) skipped, (\d+) clipped to norm", out
    )
    assert steps, out
    applied, skipped, clipped = map(int, steps.groups())
    assert applied > 0 and applied + skipped == 20  # 320 digits / 32, twice
    assert 0 <= clipped <= applied + skipped
    ((before, after),) = went_from(out, "loss")
    assert after < before


@pytest.mark.parametrize("script", ["fixed_loss_scale.py"])
def test_fixed_loss_scale_stays_fixed(out):
    for scale in (128, 512):
        assert (
            f"initial_scale={scale}: loss scale stayed {scale} (dynamic=False)"
        ) in out
        ((before, after),) = went_from(out, f"initial_scale={scale}: loss")
        assert after < before
    lost = {
        int(scale): int(count)
        for scale, count in re.findall(
            r"loss scaled by +(\d+): (\d+) of \d+ non-zero", out
        )
    }
    assert set(lost) == {1, 128, 512}
    assert lost[128] <= lost[1] and lost[512] <= lost[1]


@pytest.mark.parametrize("script", ["gan.py"])
def test_gan_two_loss_scales(out):
    reports = re.findall(
        r"discriminator loss ([\d.]+), generator loss ([\d.]+), "
        r"discriminator scale (\S+), generator scale (\S+)",
        out,
    )
    assert len(reports) == 3  # steps 50, 100 and 150
    for values in reports:
        assert all(math.isfinite(float(v)) for v in values)
        assert float(values[2]) >= 1 and float(values[3]) >= 1
    for network in ("discriminator", "generator"):
        summary = re.search(
            network + r": loss scale (\S+), (\d+) steps applied, (\d+) skipped",
            out,
        )
        assert summary, out
        assert int(summary.group(2)) + int(summary.group(3)) == 150
    ((before, after),) = went_from(out, "distance to the nearest mode")
    assert after < before


@pytest.mark.parametrize("script", ["fine_tune.py"])
def test_fine_tune_carries_float32_weights_into_mixed_float16(out):
    assert "weights carried over: ['float32', 'float32']" in out
    assert "largest difference 0\n" in out
    assert "fine-tuned model computes in: float16" in out
    float32_accuracy = float(
        re.search(r"float32 model .*test accuracy ([\d.]+)", out).group(1)
    )
    ((accuracy_before, accuracy_after),) = went_from(out, "accuracy")
    # Same weights: float16 arithmetic changes the accuracy very little.
    assert abs(accuracy_before - float32_accuracy) <= 0.05
    assert accuracy_after > accuracy_before
    ((before, after),) = went_from(out, "loss")
    assert after < before


@pytest.mark.parametrize("script", ["distributed.py"])
def test_distributed_fit_and_custom_loop(out):
    assert "replicas in sync: 2" in out
    for path in ("fit", "custom loop"):
        assert re.search(path + r": \d+ steps, 0 skipped, loss scale \d+", out)
        ((before, after),) = went_from(out, f"{path}: loss")
        assert after < before
