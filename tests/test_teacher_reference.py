"""The ``teacher`` reference kind: a second model of the family, loaded from its folder by the family's loader, frozen,
in the engine's compute dtype, scoring the student's recorded states with its own conditioning of their prompts."""

from __future__ import annotations

import pytest
import torch
from helpers import make_engine
from test_algorithms import _trajectories

from diffrl.config import SamplerConfig
from diffrl.engine.objective import BASE, Granularity, ObjectiveSpec, Reference, StepObjective
from tests.conftest import randomise_lora

SAMPLER = SamplerConfig(num_steps=3, noise_level=0.8)


class Capture(StepObjective):
    """A step objective on the teacher that records what the engine gives it; its loss is ``mean (mean − ref_mean)²``."""

    def __init__(self, source: str):
        super().__init__(ObjectiveSpec(name="capture", granularity=Granularity.STEP, reference=Reference("teacher", source=source)))
        self.seen = []

    def __call__(self, step, batch, k):
        self.seen.append({key: value.detach().clone() for key, value in step.items()})
        return ((step["mean"] - step["ref_mean"]) ** 2).mean(), {}


def test_reference_kind_teacher_needs_exactly_a_source():
    assert str(Reference("teacher", source="assets/digits_teacher")) == "teacher 'assets/digits_teacher'"
    with pytest.raises(ValueError, match="source"):
        Reference("teacher")
    with pytest.raises(ValueError, match="source"):
        Reference("base", source="somewhere")
    with pytest.raises(ValueError, match="unknown reference kind"):
        Reference("tutor", source="x")
    assert BASE.source is None


def _teacher_folder(tmp_path, seed: int):
    from pipelines.digits import DigitsAdapter

    teacher = DigitsAdapter(path=None, seed=seed)
    teacher.save_pretrained(tmp_path / f"teacher{seed}")
    return str(tmp_path / f"teacher{seed}"), teacher


def test_teacher_equal_to_the_student_scores_the_student_means(tmp_path, tiny_adapter):
    """A teacher saved from the student's own weights (LoRA B = 0 at the start) gives ``ref_mean == mean`` at every trained
    step: it encodes the prompts as the rollout did, and replays the same states with the same step kind."""
    source, _ = _teacher_folder(tmp_path, seed=0)  # tiny_adapter is DigitsAdapter(seed=0)
    batch = _trajectories(tiny_adapter, n=4)
    engine = make_engine(tiny_adapter, SAMPLER, lora_rank=4)
    objective = Capture(source)
    out = engine.train_batch(batch, objective)
    assert len(objective.seen) == 3 and out["loss"] == 0.0
    for step in objective.seen:
        torch.testing.assert_close(step["ref_mean"], step["mean"], rtol=0, atol=0)
    torch.testing.assert_close(engine.reference_cond(objective.spec.reference, batch), batch["cond"], rtol=0, atol=0)


def test_teacher_is_frozen_and_unchanged_by_a_step(tmp_path, tiny_adapter):
    """Another model as teacher: eval mode, no parameter requires grad, none gets a gradient, its weights are unchanged after an
    optimizer step that moved the student; its means differ from the student's; it is loaded once."""
    source, _ = _teacher_folder(tmp_path, seed=5)
    batch = _trajectories(tiny_adapter, n=4)
    engine = make_engine(tiny_adapter, SAMPLER, lora_rank=4)
    engine.initialize()
    randomise_lora(engine.module, seed=1)
    teacher = engine.teacher(source)
    before = {n: p.detach().clone() for n, p in teacher.denoiser.named_parameters()}
    student_before = {n: p.detach().clone() for n, p in engine.module.named_parameters() if p.requires_grad}
    objective = Capture(source)
    out = engine.train_batch(batch, objective)
    assert out["loss"] > 0 and out["metrics"]["grad_norm"] > 0
    assert engine.teacher(source) is teacher  # loaded once
    assert not teacher.denoiser.training and not teacher.text_encoder.training
    for name, p in teacher.denoiser.named_parameters():
        assert not p.requires_grad and p.grad is None
        torch.testing.assert_close(p.detach(), before[name], rtol=0, atol=0)
    assert any(not torch.equal(p.detach(), student_before[n]) for n, p in engine.module.named_parameters() if p.requires_grad)
    assert all(not torch.equal(s["ref_mean"], s["mean"]) for s in objective.seen)


def test_teacher_in_the_compute_dtype(tmp_path, tiny_adapter):
    source, _ = _teacher_folder(tmp_path, seed=5)
    engine = make_engine(tiny_adapter, SAMPLER, lora_rank=4, dtype="bfloat16")
    teacher = engine.teacher(source)
    assert {p.dtype for p in teacher.denoiser.parameters()} == {torch.bfloat16}


def test_teacher_with_its_own_text_encoder_encodes_the_prompts_itself(tmp_path, tiny_adapter):
    """A teacher whose text encoder differs from the student's reads the prompts through its own encoder, not the recorded
    conditioning."""
    source, teacher_model = _teacher_folder(tmp_path, seed=7)
    batch = _trajectories(tiny_adapter, n=4)
    engine = make_engine(tiny_adapter, SAMPLER, lora_rank=4)
    cond = engine.reference_cond(Reference("teacher", source=source), batch)
    prompts = list(batch.get("prompts").tolist())
    expected = torch.cat([teacher_model.encode([p]) for p in prompts])
    torch.testing.assert_close(cond["prompt_embeds"], expected["prompt_embeds"])
    assert not torch.equal(cond["prompt_embeds"], batch["cond"]["prompt_embeds"])


def test_a_missing_teacher_folder_is_a_one_line_error(tmp_path, tiny_adapter):
    engine = make_engine(tiny_adapter, SAMPLER, lora_rank=4)
    with pytest.raises(FileNotFoundError, match="does not exist") as info:
        engine.teacher(str(tmp_path / "nowhere"))
    assert "\n" not in str(info.value)
