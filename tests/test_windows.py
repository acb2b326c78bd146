"""Training windows (all, fraction, Flow-GRPO-Fast, MixGRPO, DanceGRPO subsets), shared initial noise,
window state in checkpoints, and every step kind and window selectable from the digits recipe."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine

from diffrl import checkpoint
from diffrl.config import SamplerConfig
from diffrl.recipes import compose
from diffrl.sampling.rollout import sample_trajectories
from diffrl.sampling.schedules import TrainingWindow
from diffrl.sampling.sde import STEP_KINDS, ode_step
from tests.conftest import randomise_lora

pytestmark = pytest.mark.usefixtures("single_thread")


def _idx(mask: torch.Tensor) -> list[int]:
    return mask.nonzero().flatten().tolist()


def test_all_and_fraction_windows():
    w = TrainingWindow("all", 10)
    m = w.masks(3)
    assert m.stochastic.all() and m.trained.all()
    f = TrainingWindow("fraction", 10, timestep_fraction=0.35)
    m = f.masks(0)
    assert m.stochastic.all() and _idx(m.trained) == [0, 1, 2]  # int(10 · 0.35) = 3, the high-noise end
    assert _idx(TrainingWindow("fraction", 10, timestep_fraction=0.01).masks(0).trained) == [0]


def test_fast_window_counts_range_and_reproducibility():
    w = TrainingWindow("fast", 10, seed=5, size=3, range_start=1, range_end=7)
    starts = []
    for step in range(200):
        m = w.masks(step)
        assert torch.equal(m.stochastic, m.trained)
        idx = _idx(m.stochastic)
        assert len(idx) == 3 and idx == list(range(idx[0], idx[0] + 3))
        assert 1 <= idx[0] and idx[-1] < 7
        starts.append(idx[0])
    assert set(starts) == {1, 2, 3, 4}  # every allowed start is drawn
    again = TrainingWindow("fast", 10, seed=5, size=3, range_start=1, range_end=7)
    assert all(torch.equal(again.masks(s).stochastic, w.masks(s).stochastic) for s in range(50))
    other = TrainingWindow("fast", 10, seed=6, size=3, range_start=1, range_end=7)
    assert any(not torch.equal(other.masks(s).stochastic, w.masks(s).stochastic) for s in range(50))


def test_random_subset_window_counts_and_reproducibility():
    w = TrainingWindow("random", 10, seed=1, timestep_fraction=0.4)
    seen = torch.zeros(10)
    for step in range(300):
        m = w.masks(step)
        assert m.stochastic.all() and int(m.trained.sum()) == 4
        seen += m.trained.float()
    assert (seen > 60).all()  # every step is trained about 40 % of the time (120 expected)
    assert torch.equal(TrainingWindow("random", 10, seed=1, timestep_fraction=0.4).masks(17).trained, w.masks(17).trained)


def test_mixgrpo_window_slides_stops_and_freezes():
    w = TrainingWindow("mixgrpo", 10, size=3, shift=2, shift_every=3)
    starts = []
    for _ in range(15):
        starts.append(_idx(w.masks(0).stochastic)[0])
        w.advance()
    assert starts == [0, 0, 0, 2, 2, 2, 4, 4, 4, 6, 6, 6, 7, 7, 7]  # stops at K − size = 7
    frozen = TrainingWindow("mixgrpo", 10, size=3, shift=2, shift_every=1, frozen=True)
    for _ in range(5):
        frozen.advance()
    assert _idx(frozen.masks(0).trained) == [0, 1, 2]


def test_mixgrpo_position_survives_a_checkpoint(tmp_path, tiny_adapter):
    settings = SamplerConfig(num_steps=4)
    engine = make_engine(tiny_adapter, settings, lora_rank=2)
    engine.initialize()
    run = TrainingWindow("mixgrpo", 10, size=2, shift=1, shift_every=2)
    for _ in range(5):
        run.advance()
    path = checkpoint.save_engine(engine, tmp_path, global_step=5, extra_state={"window": run.state_dict()})
    resumed = TrainingWindow("mixgrpo", 10, size=2, shift=1, shift_every=2)
    resumed.load_state_dict(checkpoint.load_engine(engine, path)["window"])
    for _ in range(6):
        assert torch.equal(resumed.masks(0).stochastic, run.masks(0).stochastic)
        run.advance()
        resumed.advance()
    assert resumed.position == run.position == 5
    with pytest.raises(ValueError, match="resume with the run's own sampler settings"):
        TrainingWindow("fast", 10).load_state_dict(run.state_dict())


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(kind="slide"), "unknown sampler.window"),
        (dict(kind="fast", size=11), "window_size=11"),
        (dict(kind="fast", size=4, range_start=0, range_end=3), "cannot hold a window"),
        (dict(kind="random", timestep_fraction=0.0), "timestep_fraction"),
        (dict(kind="mixgrpo", shift_every=0), "window_shift_every"),
    ],
)
def test_bad_window_settings_name_the_key(kwargs, match):
    kind = kwargs.pop("kind")
    with pytest.raises(ValueError, match=match):
        TrainingWindow(kind, 10, **kwargs)


def test_windowed_rollout_shared_noise_ode_steps_and_parity():
    from pipelines.digits import DigitsAdapter

    adapter = DigitsAdapter(path=None, seed=0)
    settings = SamplerConfig(num_steps=5, kind="flow_sde", noise_level=0.8)
    engine = make_engine(adapter, settings, lora_rank=4)
    engine.initialize()
    randomise_lora(engine.module)
    stochastic = torch.tensor([False, True, True, True, False])
    trained = torch.tensor([False, True, False, True, False])
    prompts = ["a red seven"] * 3 + ["a blue two"] * 3
    td = sample_trajectories(
        adapter, prompts, settings=settings, seeds=[11, 12, 13, 14, 15, 16], init_seeds=[1, 1, 1, 2, 2, 2],
        sde_mask=trained, stochastic_mask=stochastic,
    )
    x0 = td["latents"][:, 0]
    assert torch.equal(x0[0], x0[1]) and torch.equal(x0[1], x0[2]) and not torch.equal(x0[0], x0[3])
    # the first step is the ODE, identical within a group; the SDE steps then make them differ
    assert torch.equal(td["latents"][0, 1], td["latents"][1, 1])
    assert not torch.equal(td["latents"][0, 2], td["latents"][1, 2])
    # log-probs are recorded at every stochastic step, zero at ODE steps
    assert (td["log_probs"][:, [0, 4]] == 0).all() and (td["log_probs"][:, 1:4] != 0).all()
    assert torch.equal(td["sde_mask"][0], trained)
    # the last step is the Euler ODE step
    sig = td["sigmas"][0]
    v = adapter.predict(td["latents"][:, 4], sig[4].expand(6), td["cond"], 1.0)
    torch.testing.assert_close(td["latents"][:, 5], ode_step(v, td["latents"][:, 4], sig[4].item(), sig[5].item()).prev_sample)
    # training recomputes exactly the recorded log-probs of the trained steps
    lp = engine.infer_batch(td)["log_probs"]
    assert torch.equal(lp[:, [1, 3]], td["log_probs"][:, [1, 3]])
    with pytest.raises(ValueError, match="not stochastic"):
        sample_trajectories(adapter, prompts[:1], settings=settings, seeds=[1], sde_mask=trained, stochastic_mask=torch.zeros(5, dtype=torch.bool))


def test_dpm2_rollout_is_deterministic_and_closer_to_a_fine_euler_solve():
    from pipelines.digits import DigitsAdapter

    adapter = DigitsAdapter(path=None, seed=0)
    prompts, seeds = ["a green four"] * 2, [3, 4]

    def final(kind: str, steps: int) -> torch.Tensor:
        td = sample_trajectories(adapter, prompts, settings=SamplerConfig(num_steps=steps, kind=kind, shift=1.0), seeds=seeds)
        assert (td["log_probs"] == 0).all() and not td["sde_mask"].any()
        return td["latents"][:, -1]

    fine = final("ode", 200)
    err_euler = (final("ode", 8) - fine).abs().mean()
    err_dpm2 = (final("dpm2", 8) - fine).abs().mean()
    assert err_dpm2 < 0.7 * err_euler, (err_dpm2, err_euler)


WINDOWS = [
    ["sampler.window=all"],
    ["sampler.window=fraction", "sampler.timestep_fraction=0.5"],
    ["sampler.window=fast", "sampler.window_size=2", "sampler.window_range=[0,3]", "sampler.same_initial_noise=true"],
    ["sampler.window=mixgrpo", "sampler.window_shift_every=1", "sampler.ode_solver=dpm2"],
    ["sampler.window=random", "sampler.timestep_fraction=0.5"],
]


@pytest.mark.parametrize("overrides", [[f"sampler.kind={k}"] for k in sorted(STEP_KINDS) if k not in ("ode", "dpm2")] + WINDOWS)
def test_every_kind_and_window_trains_from_the_command_line(overrides, tmp_path):
    from diffrl.tools.cli import main

    out = tmp_path / "run"
    args = ["train", *overrides, "sampler.num_steps=4", "sampler.eval_num_steps=2", "trainer.steps=2", "trainer.prompts_per_step=2",
            "trainer.group_size=2", "eval.seeds_per_prompt=1", "eval.max_grid_images=4", f"trainer.output_dir={out}",
            "trainer.progress=false", "trainer.prompts=" + str(_prompt_file(tmp_path))]
    assert main(args) == 0
    import json

    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in lines if r["kind"] == "train"]
    assert len(train) == 2 and all(abs(r["first_ratio_mean"] - 1.0) < 1e-4 for r in train)  # on-policy: ratio 1 at the first optimizer step
    state = json.loads((out / "checkpoints" / "step_000002" / "state.json").read_text())
    assert state["window"]["count"] == 2


@pytest.mark.parametrize("kind", ["ode", "dpm2"])
def test_deterministic_kinds_refuse_to_train_with_a_clear_error(kind, tmp_path):
    cfg = compose([f"sampler.kind={kind}", "trainer.steps=1", f"trainer.output_dir={tmp_path / 'r'}"])
    from diffrl.trainer import Trainer

    with pytest.raises(ValueError, match="deterministic"):
        Trainer(cfg).train_step(0)


def _prompt_file(tmp_path):
    path = tmp_path / "prompts.txt"
    path.write_text("a red seven\na blue two\n")
    return path
