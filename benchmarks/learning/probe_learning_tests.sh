#!/usr/bin/env bash
# The slow tier's learning tests as curves: each test's run (same recipe, steps and overrides as its test) evaluated every
# EVERY steps on the 60 prompts x 2 held-out seeds, so a test's step count can be chosen with its margin in view.
# Usage: bash benchmarks/learning/probe_learning_tests.sh OUT [PARALLEL] [NAME...]   (default: all, 2 at a time, 1 thread each)
# Each run writes OUT/<name>/metrics.jsonl and summary.json; `python benchmarks/learning/probe_curves.py OUT` prints the curves.
set -euo pipefail
out=${1:?usage: probe_learning_tests.sh OUT [PARALLEL] [NAME...]}; shift
parallel=${1:-2}; [ $# -gt 0 ] && shift
declare -A RUNS=(
  [awm]="experiment=digits_awm trainer.steps=60 eval.every=10"
  [awm_hack]="experiment=digits_awm trainer.steps=40 eval.every=5 algorithm.kl_beta=0 algorithm.lr=1e-3"
  [dgpo]="experiment=digits_dgpo trainer.steps=25 eval.every=5"
  [flow_dppo]="experiment=digits_flow_dppo trainer.steps=20 eval.every=5"
  [tempflow]="experiment=digits_tempflow_grpo trainer.steps=40 eval.every=10"
  [gardo]="experiment=digits_gardo trainer.steps=40 eval.every=10"
  [opd]="experiment=digits_opd trainer.steps=40 eval.every=10"
)
names=("$@"); [ ${#names[@]} -eq 0 ] && names=(awm awm_hack dgpo flow_dppo tempflow gardo opd)
mkdir -p "$out"
for n in "${names[@]}"; do
  echo "$n ${RUNS[$n]} eval.seeds_per_prompt=2 trainer.checkpoint_every=0 trainer.progress=false trainer.wandb=disabled trainer.threads=1 trainer.output_dir=$out/$n"
done | xargs -P "$parallel" -L 1 bash -c 'name=$0; OMP_NUM_THREADS=1 diffrl train "$@" > "'"$out"'/$name.log" 2>&1 && echo "done $name" || echo "FAILED $name"'
