"""One evaluation path and a typed sampling request: the trainer's rollout request carries the algorithm's plan as a
``SampleRequest``; the ``Evaluator`` gives the same images and scores through a worker (the trainer, the CLI) and
on an adapter in this process (the notebooks); bad requests are one-line errors."""

from __future__ import annotations

import pytest
import torch

from diffrl.algorithms import build_algorithm
from diffrl.distributed.workers import ActorRolloutRefWorker
from diffrl.recipes import compose
from diffrl.sampling.evaluator import Evaluator, evaluate, local_generate
from diffrl.sampling.request import REQUEST_KEY, SampleRequest, sample_batch
from diffrl.rollout_driver import rollout_request
from diffrl.run_setup import run_context, worker_config
from diffrl.sampling.schedules import build_window
from rewards.base import build_reward

pytestmark = pytest.mark.usefixtures("single_thread")


@pytest.mark.parametrize("experiment, record_means", [("digits_flow_grpo", False), ("digits_flow_dppo", True), ("digits_nft", False)])
def test_rollout_request_carries_the_plan_typed(experiment, record_means):
    cfg = compose([f"experiment={experiment}", "trainer.prompts_per_step=2", "trainer.group_size=3", "sampler.micro_batch_size=4"])
    algorithm = build_algorithm(cfg.algorithm, run_context(cfg))
    masks = build_window(cfg.sampler, cfg.trainer.seed).masks(0)
    batch = rollout_request(algorithm.run, algorithm, ["a red seven", "a blue two"], masks, 0)
    plan = algorithm.rollout_plan(masks)
    request = SampleRequest.of(batch)
    assert isinstance(request, SampleRequest) and batch.batch_size == torch.Size([6])
    assert request.policy == plan.policy and request.record_means is record_means and request.micro_batch_size == 4
    assert torch.equal(request.trained, plan.trained) and torch.equal(request.stochastic, plan.stochastic)
    assert request.eval_num_steps is None and not request.evaluation
    assert batch["group_id"].tolist() == [0, 0, 0, 1, 1, 1] and len(set(batch["seeds"].tolist())) == 6
    # a slice (one rank's share) keeps the request
    assert SampleRequest.of(batch[:3]) is request or SampleRequest.of(batch[:3]) == request


def test_worker_and_local_evaluations_agree():
    """The same (prompt, seed) pairs through a worker's generate_sequences and through local_generate on the worker's
    own adapter: identical images, per-sample scores and means; each mean is the mean of its per-sample scores."""
    cfg = compose(["experiment=digits_flow_grpo", "sampler.eval_num_steps=4"])
    worker = ActorRolloutRefWorker(worker_config(cfg))
    worker.init_model()
    metrics = {name: build_reward(name) for name in ("digits", "digits_gold")}
    evaluator = Evaluator(metrics, eval_num_steps=4, micro_batch_size=2, distribution=True)
    prompts, seeds = ["a red seven", "a blue two", "a red seven", "a blue two"], [5, 6, 7, 8]
    through_worker = evaluator.run(worker.generate_sequences, prompts, seeds)
    local = evaluator.run(local_generate(worker.adapter, worker.config.sampler), prompts, seeds)
    assert torch.equal(through_worker.images, local.images)
    for name in metrics:
        torch.testing.assert_close(through_worker.scores[name], local.scores[name], rtol=0, atol=0)
        assert through_worker.metrics[f"eval/{name}"] == pytest.approx(float(local.scores[name].mean()), rel=1e-6)
        assert len(through_worker.outputs[name]) == 4
    assert "eval/diversity_pixel" in through_worker.metrics and through_worker.metrics["eval/seconds"] > 0
    # the functional form used by the pretraining scripts is the same evaluation
    means, images = evaluate(worker.adapter, prompts, seeds=seeds, num_steps=4, guidance_scale=cfg.sampler.guidance_scale, metrics=metrics,
                             height=cfg.sampler.height, width=cfg.sampler.width)
    assert torch.equal(images, local.images) and means["eval/digits"] == pytest.approx(local.metrics["eval/digits"], rel=1e-6)


def test_bad_requests_are_one_line_errors():
    with pytest.raises(ValueError, match="policy must be one of"):
        SampleRequest(policy="best")
    with pytest.raises(ValueError, match="eval_num_steps must be"):
        SampleRequest(eval_num_steps=0)
    with pytest.raises(ValueError, match="2 prompts but 3 seeds"):
        sample_batch(["a", "b"], [1, 2, 3], SampleRequest())
    batch = sample_batch(["a"], [1], SampleRequest())
    batch.set_non_tensor(REQUEST_KEY, {"policy": "current"})
    with pytest.raises(TypeError, match="must be a SampleRequest"):
        SampleRequest.of(batch)
