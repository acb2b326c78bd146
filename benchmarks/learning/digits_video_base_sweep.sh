#!/usr/bin/env bash
# Sweep of the digits-video base's pretraining settings on one GPU (issue 37): how far longer, wider or otherwise
# changed pretraining takes the base beyond the CPU budget's 2800 steps. Every variant runs scripts/pretrain_digits_video.py in its own process,
# reusing the shipped reward nets, evaluating every prompt × 2 held-out seeds as the recipes do (guidance 1) and once
# more at guidance 3 at the end. Usage (on the device): bash benchmarks/learning/digits_video_base_sweep.sh "$OUT"
set -u
out=${1:?output folder}
minutes=${MINUTES:-6}
run() {
  name=$1; shift
  mkdir -p "$out/$name" && cp assets/digits_video/metadata.json "$out/$name/" && cp -r assets/digits_video/reward_frames assets/digits_video/reward_motion "$out/$name/"
  python3 scripts/pretrain_digits_video.py --out "$out/$name" --reuse-reward-nets --device cuda --threads 2 \
    --eval-guidance 3 --max-minutes "$minutes" "$@" > "$out/$name.log" 2>&1 &
}
OLD="--prediction velocity --direction-noise 0.5 --colour-noise 0.3 --lr 1e-3 --lr-schedule constant --warmup 0"  # the first base
run old       $OLD --max-steps 2400 --eval-every 1200
run oldlong   $OLD --max-steps 40000 --eval-every 4000
SECOND="--lr-schedule cosine --direction-noise 0.2"  # the second base's settings (the rows of RESULTS.md's sweep table)
run second    $SECOND --max-steps 2800 --eval-every 1400
run long12k   $SECOND --max-steps 12000 --eval-every 2400
run long40k   $SECOND --max-steps 40000 --eval-every 4000
run velocity  $SECOND --prediction velocity --max-steps 2800 --eval-every 1400
run wide      $SECOND --heads 8 --ffn 512 --max-steps 12000 --eval-every 2400
run noisy     $SECOND --direction-noise 0.5 --colour-noise 0.3 --max-steps 12000 --eval-every 2400
run third     --max-steps 2800 --eval-every 1400  # the script's defaults: the shipped third base
wait
grep -h '"base' "$out"/*.log
