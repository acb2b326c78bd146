#!/usr/bin/env bash
# Probes of the digits-video recipes on one GPU (issue 37): each line below is one `diffrl train` run in its own
# process (model.device=cuda), all at once, from the base in assets/digits_video (or BASE=<folder>), so that the
# settings worth a 10-minute CPU run are found in a few GPU minutes. Exploratory: the GPU's numerics differ from the
# CPU's, so a probe's gold says which settings learn, not the CPU recipe's number.
# Usage (on the device): bash benchmarks/learning/digits_video_rl_probes.sh "$OUT" [label ...]   (no label: all;
# STEPS=n overrides every probe's steps)
set -u
out=${1:?output folder}; shift
base=${BASE:-assets/digits_video}
TRAIN="import sys; from diffrl.recipes import compose; from diffrl.trainer import Trainer; Trainer(compose(sys.argv[1:])).fit()"
# the recipes as they were when the probes ran (RESULTS.md's probe table); the shipped recipes are fg_recipe and dg_recipe
FG_OLD="experiment=digits_video_flow_grpo sampler.window=all trainer.steps=120"
DG_OWN="experiment=digits_video_dance_grpo sampler.noise_level=0.7 sampler.window=random sampler.timestep_fraction=0.6 sampler.same_initial_noise=false trainer.steps=120"
declare -A PROBES=(
  [fg_recipe]="experiment=digits_video_flow_grpo"
  [dg_recipe]="experiment=digits_video_dance_grpo"
  [fg]="$FG_OLD"
  [fg_kl04]="$FG_OLD algorithm.kl_beta=0.04"
  [fg_a07]="$FG_OLD sampler.noise_level=0.7"
  [fg_lr5e4]="$FG_OLD algorithm.lr=5e-4"
  [fg_prod]="$FG_OLD +reward.options.digits_video.combine=product"
  [fg_prod_lr5e4]="$FG_OLD +reward.options.digits_video.combine=product algorithm.lr=5e-4"
  [fg_kl04_a07]="$FG_OLD algorithm.kl_beta=0.04 sampler.noise_level=0.7"
  [dg]="$DG_OWN"
  [dg_lr4e3]="$DG_OWN algorithm.lr=4e-3"
  [dg_eta03]="$DG_OWN sampler.noise_level=0.3"
  [dg_tf1]="$DG_OWN sampler.timestep_fraction=1.0"
  [dg_kl0]="$DG_OWN algorithm.kl_beta=0"
  [fg_lr2e3]="$FG_OLD algorithm.lr=2e-3"
  [fg_mb32]="$FG_OLD algorithm.mini_batch_size=32"
  [fg_mb16]="$FG_OLD algorithm.mini_batch_size=16"
  [fg_a07_mb32]="$FG_OLD sampler.noise_level=0.7 algorithm.mini_batch_size=32"
  [fg_tf05_s200]="$FG_OLD sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [fg_s200]="$FG_OLD trainer.steps=200 eval.every=50"
  [dg_same]="$DG_OWN sampler.same_initial_noise=true"
  [dg_same_tf1]="$DG_OWN sampler.same_initial_noise=true sampler.timestep_fraction=1.0"
  [dg_eta1]="$DG_OWN sampler.noise_level=1.0"
  [dg_mb32]="$DG_OWN algorithm.mini_batch_size=32"
  [dg_same_mb32]="$DG_OWN sampler.same_initial_noise=true algorithm.mini_batch_size=32"
  [dg_tf1_mb32]="$DG_OWN sampler.timestep_fraction=1.0 algorithm.mini_batch_size=32"
  [fg_tf05_s160]="$FG_OLD sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=160 eval.every=40"
  [fg_tf05_s200_seed1]="$FG_OLD sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50 trainer.seed=1"
  [fg_tf03_s200]="$FG_OLD sampler.window=fraction sampler.timestep_fraction=0.3 trainer.steps=200 eval.every=50"
  [fg_tf05_lr15_s160]="$FG_OLD sampler.window=fraction sampler.timestep_fraction=0.5 algorithm.lr=1.5e-3 trainer.steps=160 eval.every=40"
  [dg_same_tf05_s200]="$DG_OWN sampler.same_initial_noise=true sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_frac05_s200]="$DG_OWN sampler.same_initial_noise=true sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_frac05_s200]="$DG_OWN sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_eta05_frac05_s200]="$DG_OWN sampler.same_initial_noise=true sampler.noise_level=0.5 sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_eta1_frac05_s200]="$DG_OWN sampler.same_initial_noise=true sampler.noise_level=1.0 sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_lr1e3_frac05_s200]="$DG_OWN sampler.same_initial_noise=true algorithm.lr=1e-3 sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_kl0_frac05_s200]="$DG_OWN sampler.same_initial_noise=true algorithm.kl_beta=0 sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_tf03_s200]="$DG_OWN sampler.same_initial_noise=true sampler.timestep_fraction=0.3 trainer.steps=200 eval.every=50"
  [dg_same_eta03_frac05_s200]="$DG_OWN sampler.same_initial_noise=true sampler.noise_level=0.3 sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_eta05_tf05_s200]="$DG_OWN sampler.same_initial_noise=true sampler.noise_level=0.5 sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_eta05_frac05_kl04_s200]="$DG_OWN sampler.same_initial_noise=true sampler.noise_level=0.5 algorithm.kl_beta=0.04 sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_eta05_frac05_lr1e3_s200]="$DG_OWN sampler.same_initial_noise=true sampler.noise_level=0.5 algorithm.lr=1e-3 sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_eta05_tf1_s160]="$DG_OWN sampler.same_initial_noise=true sampler.noise_level=0.5 sampler.timestep_fraction=1.0 trainer.steps=160 eval.every=40"
  [dg_same_eta03_tf1_s160]="$DG_OWN sampler.same_initial_noise=true sampler.noise_level=0.3 sampler.timestep_fraction=1.0 trainer.steps=160 eval.every=40"
  [dg_eta05_frac05_s200]="$DG_OWN sampler.noise_level=0.5 sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_eta05_frac05_prod_s200]="$DG_OWN sampler.same_initial_noise=true sampler.noise_level=0.5 +reward.options.digits_video.combine=product sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_eta05_frac05_g16_s200]="$DG_OWN sampler.same_initial_noise=true sampler.noise_level=0.5 trainer.prompts_per_step=4 trainer.group_size=16 sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_eta05_frac07_s160]="$DG_OWN sampler.same_initial_noise=true sampler.noise_level=0.5 sampler.window=fraction sampler.timestep_fraction=0.7 trainer.steps=160 eval.every=40"
  [dg_same_eta05_frac05_mb32_s200]="$DG_OWN sampler.same_initial_noise=true sampler.noise_level=0.5 algorithm.mini_batch_size=32 sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg_same_eta05_frac05_kl05_lr3e3_s200]="$DG_OWN sampler.same_initial_noise=true sampler.noise_level=0.5 algorithm.kl_beta=0.05 algorithm.lr=3e-3 sampler.window=fraction sampler.timestep_fraction=0.5 trainer.steps=200 eval.every=50"
  [dg20_same_tf03]="$DG_OWN sampler.same_initial_noise=true sampler.num_steps=20 sampler.timestep_fraction=0.3"
  [dg20_same_eta05_tf03]="$DG_OWN sampler.same_initial_noise=true sampler.num_steps=20 sampler.noise_level=0.5 sampler.timestep_fraction=0.3"
  [dg20_same_eta05_tf03_s160]="$DG_OWN sampler.same_initial_noise=true sampler.num_steps=20 sampler.noise_level=0.5 sampler.timestep_fraction=0.3 trainer.steps=160 eval.every=40"
  [dg20_same_tf05]="$DG_OWN sampler.same_initial_noise=true sampler.num_steps=20 sampler.timestep_fraction=0.5"
  [dg20_tf03]="$DG_OWN sampler.num_steps=20 sampler.timestep_fraction=0.3"
  [dg20_same_eta05_frac03]="$DG_OWN sampler.same_initial_noise=true sampler.num_steps=20 sampler.noise_level=0.5 sampler.window=fraction sampler.timestep_fraction=0.3"
  [dg16_same_eta05_tf04]="$DG_OWN sampler.same_initial_noise=true sampler.num_steps=16 sampler.noise_level=0.5 sampler.timestep_fraction=0.4"
  [dg20_same_eta1_tf03]="$DG_OWN sampler.same_initial_noise=true sampler.num_steps=20 sampler.noise_level=1.0 sampler.timestep_fraction=0.3"
  [dg20_same_eta05_tf03_kl0]="$DG_OWN sampler.same_initial_noise=true sampler.num_steps=20 sampler.noise_level=0.5 sampler.timestep_fraction=0.3 algorithm.kl_beta=0"
  [dg20_same_eta03_tf03]="$DG_OWN sampler.same_initial_noise=true sampler.num_steps=20 sampler.noise_level=0.3 sampler.timestep_fraction=0.3"
  [dg20_same_tf03_lr1e3]="$DG_OWN sampler.same_initial_noise=true sampler.num_steps=20 sampler.timestep_fraction=0.3 algorithm.lr=1e-3"
  [dg20_same_tf03_kl05]="$DG_OWN sampler.same_initial_noise=true sampler.num_steps=20 sampler.timestep_fraction=0.3 algorithm.kl_beta=0.05"
  [nft]="experiment=digits_video_nft"
  [nft_lr1e3]="experiment=digits_video_nft algorithm.lr=1e-3"
)
labels=("$@"); [ ${#labels[@]} -eq 0 ] && labels=("${!PROBES[@]}")
for label in "${labels[@]}"; do
  [ -n "${PROBES[$label]+x}" ] || { echo "unknown probe $label (known: ${!PROBES[*]})"; exit 2; }
  # shellcheck disable=SC2086
  OMP_NUM_THREADS=1 python3 -c "$TRAIN" ${PROBES[$label]} ${STEPS:+trainer.steps=$STEPS} model.path="$base" model.device=cuda \
    trainer.output_dir="$out/$label" trainer.threads=1 trainer.progress=false trainer.checkpoint_every=0 trainer.wandb=disabled \
    > "$out/$label.log" 2>&1 &
done
wait
for label in "${labels[@]}"; do
  echo "== $label: ${PROBES[$label]}"; grep -h "^eval " "$out/$label.log" | cut -c1-400; tail -1 "$out/$label.log" | cut -c1-300
done
