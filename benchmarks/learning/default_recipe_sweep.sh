#!/usr/bin/env bash
# Settings of the default recipe (`digits_flow_grpo`, README command 1) side by side, each `diffrl train` on one CPU
# thread in its own process, evaluated every EVERY steps (issue 53 item 4: fidelity >= +30 with realness and Frechet no
# worse than the base, in no more CPU time than today). Meant for a machine with many cores (the device machine's 16):
#   bash benchmarks/learning/default_recipe_sweep.sh OUT [label ...]     (no label: all; STEPS, EVERY, LIMIT_S override)
# Each run writes OUT/<label>/{metrics.jsonl,summary.json,config.yaml}; then
#   python benchmarks/learning/probe_curves.py OUT      prints the curves.
# Exploratory: another CPU's float32 kernels give slightly other numbers; the chosen setting is re-run on the work machine.
set -u
out=${1:?output folder}; shift
steps=${STEPS:-120}; every=${EVERY:-20}; limit=${LIMIT_S:-3600}
declare -A RUNS=(
  [base]=""
  [kl04]="algorithm.kl_beta=0.04"
  [kl1]="algorithm.kl_beta=0.1"
  [kl1_lr15]="algorithm.kl_beta=0.1 algorithm.lr=1.5e-3"
  [kl1_lr2]="algorithm.kl_beta=0.1 algorithm.lr=2e-3"
  [kl1_lr3]="algorithm.kl_beta=0.1 algorithm.lr=3e-3"
  [kl04_lr2]="algorithm.kl_beta=0.04 algorithm.lr=2e-3"
  [kl2_lr2]="algorithm.kl_beta=0.2 algorithm.lr=2e-3"
  [kl2_lr3]="algorithm.kl_beta=0.2 algorithm.lr=3e-3"
  [kl1_a07]="algorithm.kl_beta=0.1 sampler.noise_level=0.7"
  [kl1_mb32]="algorithm.kl_beta=0.1 algorithm.mini_batch_size=32"
  [kl1_lr2_mb32]="algorithm.kl_beta=0.1 algorithm.lr=2e-3 algorithm.mini_batch_size=32"
  [kl2_lr2_mb32]="algorithm.kl_beta=0.2 algorithm.lr=2e-3 algorithm.mini_batch_size=32"
  [kl1_same]="algorithm.kl_beta=0.1 sampler.same_initial_noise=true"
  [kl1_lr2_same]="algorithm.kl_beta=0.1 algorithm.lr=2e-3 sampler.same_initial_noise=true"
)
labels=("$@"); [ ${#labels[@]} -eq 0 ] && labels=("${!RUNS[@]}")
mkdir -p "$out"
for label in "${labels[@]}"; do
  # shellcheck disable=SC2086
  CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1 timeout "$limit" "${PYTHON:-python3}" -c "import sys; from diffrl.recipes import compose; from diffrl.trainer import Trainer; Trainer(compose(sys.argv[1:])).fit()" experiment=digits_flow_grpo ${RUNS[$label]} trainer.steps="$steps" \
    eval.every="$every" trainer.checkpoint_every=0 trainer.threads=1 trainer.progress=false trainer.wandb=disabled \
    trainer.output_dir="$out/$label" > "$out/$label.log" 2>&1 &
done
wait
