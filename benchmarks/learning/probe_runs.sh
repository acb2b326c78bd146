#!/usr/bin/env bash
# Named sets of `diffrl train` runs side by side, each on one CPU thread in its own process, evaluated along the way, so
# that settings (or a test's step count) are chosen with the curves in view. Three sets:
#   learning_tests   the slow tier's learning tests, each with its test's recipe, steps and overrides (issue 51)
#   default_recipe   settings on top of the default recipe *as it was until 2026-12-07* (no KL, lr 1e-3, one optimizer
#                    step per RL step, 120 steps; issue 53 item 4), STEPS/EVERY override its steps and evaluations
#   compose          the compose recipes under the exact-count training reward, with and without a KL (issue 53)
# Usage: [PARALLEL=n] [LIMIT_S=s] [PYTHON=python] bash benchmarks/learning/probe_runs.sh SET OUT [label ...]
#   (no label: the whole set; PARALLEL default: all at once, meant for the device machine's 16 cores; 2 on 2 cores)
# Each run writes OUT/<label>/{metrics.jsonl,summary.json,config.yaml} and OUT/<label>.log; then
#   python benchmarks/learning/probe_curves.py OUT      prints the curves.
# Another CPU's float32 kernels can give slightly other numbers: re-run the chosen setting on the work machine.
set -u
set_name=${1:?usage: probe_runs.sh SET OUT [label ...]}; out=${2:?usage: probe_runs.sh SET OUT [label ...]}; shift 2
declare -A RUNS
case "$set_name" in
  learning_tests)
    RUNS=(
      [awm]="experiment=digits_awm trainer.steps=60 eval.every=10"
      [awm_hack]="experiment=digits_awm trainer.steps=40 eval.every=5 algorithm.kl_beta=0 algorithm.lr=1e-3"
      [dgpo]="experiment=digits_dgpo trainer.steps=25 eval.every=5"
      [flow_dppo]="experiment=digits_flow_dppo trainer.steps=20 eval.every=5"
      [tempflow]="experiment=digits_tempflow_grpo trainer.steps=40 eval.every=10"
      [gardo]="experiment=digits_gardo trainer.steps=40 eval.every=10"
      [opd]="experiment=digits_opd trainer.steps=40 eval.every=10"
    )
    common="eval.seeds_per_prompt=2" ;;
  default_recipe)
    RUNS=(
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
    common="experiment=digits_flow_grpo algorithm.kl_beta=0 algorithm.lr=1e-3 algorithm.mini_batch_size=null trainer.steps=${STEPS:-120} eval.every=${EVERY:-20}" ;;
  compose)
    # the compose recipes under the "exact" training reward (the reward group's rule; issue 53 items 1 and 3), with and without a pull to the base,
    # curves to 100 steps for a ~10-CPU-minute budget (8 prompts x 8 at ~10 s a step on one thread of the work machine)
    RUNS=(
      [n_exact_lr15]="experiment=digits_compose_nft algorithm.lr=1.5e-3"
      [n_exact_lr2]="experiment=digits_compose_nft algorithm.lr=2e-3"
      [n_exact_kl1_lr2]="experiment=digits_compose_nft algorithm.kl_beta=0.1 algorithm.lr=2e-3"
      [n_exact_kl1_lr3]="experiment=digits_compose_nft algorithm.kl_beta=0.1 algorithm.lr=3e-3"
      [n_exact_kl2_lr3]="experiment=digits_compose_nft algorithm.kl_beta=0.2 algorithm.lr=3e-3"
      [n_exact_kl1_lr2_t2]="experiment=digits_compose_nft algorithm.kl_beta=0.1 algorithm.lr=2e-3 algorithm.nft_num_timesteps=2"
      [n_exact_kl2_lr3_t2]="experiment=digits_compose_nft algorithm.kl_beta=0.2 algorithm.lr=3e-3 algorithm.nft_num_timesteps=2"
      [n_exact_kl15_lr25]="experiment=digits_compose_nft algorithm.kl_beta=0.15 algorithm.lr=2.5e-3"
      [n_exact_kl3_lr4]="experiment=digits_compose_nft algorithm.kl_beta=0.3 algorithm.lr=4e-3"
      [n_exact_kl03_lr2]="experiment=digits_compose_nft algorithm.kl_beta=0.03 algorithm.lr=2e-3"
      [n_exact_t2_lr2]="experiment=digits_compose_nft algorithm.nft_num_timesteps=2 algorithm.lr=2e-3"
      [g_exact_kl1_lr5]="experiment=digits_compose_flow_grpo algorithm.kl_beta=0.1 algorithm.lr=5e-3 algorithm.mini_batch_size=\${optimizer_steps:2}"
      [g_exact_kl03_lr3]="experiment=digits_compose_flow_grpo algorithm.kl_beta=0.03 algorithm.lr=3e-3 algorithm.mini_batch_size=\${optimizer_steps:2}"
      [d_exact]="experiment=digits_compose_dgpo"
      [d_exact_kl1_lr2]="experiment=digits_compose_dgpo algorithm.kl_beta=0.1 algorithm.lr=2e-3"
      [p_exact]="experiment=digits_compose_flow_dppo"
      [p_exact_kl1_lr2]="experiment=digits_compose_flow_dppo algorithm.kl_beta=0.1 algorithm.lr=2e-3"
      [f_exact]="experiment=digits_compose_flow_grpo_fast"
      [f_exact_kl1_lr3]="experiment=digits_compose_flow_grpo_fast algorithm.kl_beta=0.1 algorithm.lr=3e-3"
    )
    common="trainer.steps=${STEPS:-100} eval.every=${EVERY:-20}" ;;
  *) echo "unknown set $set_name (known: learning_tests, default_recipe, compose)"; exit 2 ;;
esac
labels=("$@"); [ ${#labels[@]} -eq 0 ] && labels=("${!RUNS[@]}")
for label in "${labels[@]}"; do
  [ -n "${RUNS[$label]+x}" ] || { echo "unknown label $label in $set_name (known: ${!RUNS[*]})"; exit 2; }
done
mkdir -p "$out"
export OUT_DIR="$out" LIMIT_S="${LIMIT_S:-36000}" PYTHON="${PYTHON:-python3}" CUDA_VISIBLE_DEVICES= OMP_NUM_THREADS=1
# one line per run: its label, then its overrides (the set's common ones first, the run's own after them: later wins)
for label in "${labels[@]}"; do
  echo "$label $common ${RUNS[$label]} trainer.checkpoint_every=0 trainer.threads=1 trainer.progress=false trainer.wandb=disabled trainer.output_dir=$out/$label"
done | xargs -P "${PARALLEL:-${#labels[@]}}" -L 1 bash -c 'timeout "$LIMIT_S" "$PYTHON" -c "import sys; from diffrl.recipes import compose; from diffrl.trainer import Trainer; Trainer(compose(sys.argv[1:])).fit()" "$@" > "$OUT_DIR/$0.log" 2>&1 && echo "done $0" || echo "FAILED or stopped $0"'
