"""Fidelity for the digits-compose and digits-edit worlds (issue 39 item 6): the object realness check on canvases, the
strict reading of what an edit must keep, and each fidelity gold as the conjunction of its parts."""

import torch

from rewards.base import build_reward
from rewards.digits.compose import load_digits_12, render as render_canvas, to_uint8
from rewards.digits.compose_judge import object_realness, rendered_real_canvases
from rewards.digits.data import COLOUR_NAMES, DIGIT_WORDS, load_digit_intensities
from rewards.digits.edit import COLOUR_KEPT_SHARE, hue_share, recolour_instruction, redraw_instruction, strict_preservation
from rewards.digits.judge2 import render
from rewards.digits.realness import PASS_QUANTILE, realness_split


def test_object_realness_passes_real_digits_and_fails_blobs_and_noise():
    check = object_realness()
    assert check.calibration_pass >= PASS_QUANTILE
    assert check.test_pass >= 0.92  # real digits used neither as neighbours nor for τ (measured 0.963)
    blobs = torch.zeros(6, 3, 32, 32)
    for i in range(6):  # a filled rectangle in one slot, each in a palette colour's hue
        blobs[i, i % 3, 3 + i % 3:13, 2:12 + i % 3] = 1.0
    noise = torch.rand(6, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    assert not check.passes(to_uint8(blobs)).any() and not check.passes(to_uint8(noise)).any()
    # four real test digits on one canvas, then the same canvas with one of them replaced by a blob
    _, _, test = realness_split()
    x12, _ = load_digits_12()
    objects = [(slot, 0, slot) for slot in range(4)]
    four = render_canvas(objects, [x12[int(i)] for i in test[:4]])
    one_blob = four.clone()
    one_blob[:, 18:30, 18:30] = 0.0
    one_blob[0, 18:30, 19:29] = 1.0
    assert check.passes(to_uint8(torch.stack([four, one_blob]))).tolist() == [True, False]
    # an empty canvas has no object to fail
    assert bool(check.passes(torch.zeros(1, 3, 32, 32, dtype=torch.uint8))[0])


def test_compose_fidelity_is_gold_and_every_object_real():
    fidelity, gold = build_reward("digits_compose_fidelity"), build_reward("digits_compose_gold")
    _, _, test = realness_split()
    x12, labels = load_digits_12()
    canvases, prompts = [], []
    for k, i in enumerate(test[:24].tolist()):
        digit, colour = int(labels[i]), k % len(COLOUR_NAMES)
        canvas = render_canvas([(k % 4, digit, colour)], [x12[i]])
        if k % 3 == 2:  # the right colour as a filled square: the judge's net still names some digit, realness fails
            canvas = torch.zeros_like(canvas)
            r, c = divmod(k % 4, 2)
            canvas[:, r * 16 + 2:r * 16 + 14, c * 16 + 2:c * 16 + 14] = render(torch.ones(1, 1, 12, 12), torch.tensor([colour]))[0].float() / 255.0
        canvases.append(canvas)
        prompts.append(f"a {COLOUR_NAMES[colour]} {DIGIT_WORDS[digit]}")
    images = to_uint8(torch.stack(canvases))
    out = fidelity(images, prompts)
    right = gold(images, prompts)["digits_compose_gold"].bool()
    assert torch.equal(out["digits_compose_fidelity"], (right & out["digits_compose_real"].bool() & out["digits_compose_exact"].bool()).float())
    real = out["digits_compose_real"].bool()
    is_blob = torch.tensor([k % 3 == 2 for k in range(24)])
    assert not real[is_blob].any() and real[~is_blob].float().mean() >= 0.85  # real digits pass ≈ 96 % (test_pass)
    assert right[real].float().mean() >= 0.85  # real digits in their asked colour: the judge reads them
    assert out["digits_compose_fidelity"][~real].sum() == 0
    assert fidelity.groups(prompts) == gold.groups(prompts)  # per-task table as the gold's
    assert out["digits_compose_exact"].all()  # one object asked, one drawn
    # the asked digit drawn twice: GenEval's "≥ 1" holds, the canvas does not hold exactly what was asked
    k = next(k for k in range(24) if not is_blob[k] and real[k] and right[k])  # a digit the judge reads and that passes
    i, digit, colour = int(test[k]), int(labels[int(test[k])]), 1
    copies = to_uint8(render_canvas([(0, digit, colour), (3, digit, colour)], [x12[i], x12[i]]))[None]
    prompt = [f"a {COLOUR_NAMES[colour]} {DIGIT_WORDS[digit]}"]
    twice = fidelity(copies, prompt)
    assert gold(copies, prompt)["digits_compose_gold"].item() == 1.0
    assert twice["digits_compose_exact"].item() == 0.0 and twice["digits_compose_fidelity"].item() == 0.0
    assert twice["digits_compose_real"].item() == 1.0  # both copies are a real digit
    assert build_reward("digits_compose_exact")(copies, prompt)["digits_compose_exact"].item() == 0.0


def test_rendered_real_canvases_hold_one_digit_each():
    canvases = rendered_real_canvases(torch.arange(8), seed=5)
    assert canvases.shape == (8, 3, 32, 32) and canvases.dtype == torch.uint8
    x12, _ = load_digits_12()
    ink = canvases.float().amax(1).flatten(1).sum(1) / 255.0
    # every pixel of the 12×12 digit, scaled by its palette colour's brightest channel (0.9 to 1.0)
    ratio = ink / x12[:8].flatten(1).sum(1)
    assert ((ratio > 0.88) & (ratio < 1.01)).all(), ratio
    slots = canvases.amax(1).view(8, 2, 16, 2, 16).amax((2, 4)) > 0  # which 16×16 slots hold ink
    assert (slots.flatten(1).sum(1) == 1).all()


def test_strict_preservation_keeps_copies_of_the_drawing_and_nothing_else():
    strict = strict_preservation()
    assert 0.02 < strict.keep_threshold < 0.2  # RMS of peak-scaled ink: well under a stroke's contrast
    assert strict.other_pass <= 0.10  # test pairs of different drawings of one digit (the 5th percentile on calibration)
    intensity, labels = load_digit_intensities()
    _, _, test = realness_split()
    src = render(intensity[test], torch.full((len(test),), 2)).float() / 255.0
    # a recolour that copies the drawing, one pixel off or dimmer, keeps it
    copy = render(torch.roll(intensity[test], 1, dims=3), torch.full((len(test),), 4)).float() / 255.0
    dim = render(intensity[test] * 0.6, torch.full((len(test),), 0)).float() / 255.0
    assert strict.drawing_kept(copy, src).all() and strict.drawing_kept(dim, src).all()
    # another person's drawing of the same digit does not
    other = [next(j for j, u in enumerate(test.tolist()) if labels[u] == labels[t] and j != i) for i, t in enumerate(test.tolist())]
    assert strict.drawing_kept(src[other], src).float().mean() <= 0.10


def test_hue_share_closed_form():
    red, blue = render(torch.ones(1, 1, 16, 16), torch.tensor([0])), render(torch.ones(1, 1, 16, 16), torch.tensor([2]))
    half = torch.cat([red[..., :8], blue[..., 8:]], -1).float() / 255.0  # equal brightness: each hue holds half the ink
    quarter = torch.cat([red[..., :12], blue[..., 12:]], -1).float() / 255.0
    assert hue_share(half, torch.tensor([0])).item() == torch.tensor(0.5).item()
    assert abs(hue_share(quarter, torch.tensor([0])).item() - 0.75) < 1e-6
    assert hue_share(red.float() / 255.0, torch.tensor([0])).item() == 1.0
    assert COLOUR_KEPT_SHARE == 0.9


def test_edit_fidelity_reads_what_the_instruction_said_to_keep():
    fidelity = build_reward("digits_edit_fidelity")
    intensity, labels = load_digit_intensities()
    _, _, test = realness_split()
    by_digit = {d: [int(i) for i in test if labels[i] == d] for d in range(10)}
    sources, edits, prompts, expected = [], [], [], []
    for d in range(10):
        a, b = by_digit[d][:2]
        c_src, c_new = d % 6, (d + 1) % 6
        source = render(intensity[a:a + 1], torch.tensor([c_src]))[0]
        # 1. a recolour that keeps the drawing: every part holds
        sources.append(source); edits.append(render(intensity[a:a + 1], torch.tensor([c_new]))[0])
        prompts.append(recolour_instruction(c_new)); expected.append(1.0)
        # 2. a recolour drawn as another person's digit: class kept, drawing not → 0
        sources.append(source); edits.append(render(intensity[b:b + 1], torch.tensor([c_new]))[0])
        prompts.append(recolour_instruction(c_new)); expected.append(0.0)
        # 3. a redraw into the next digit, in the source's colour → 1; 4. the same with its right half in another hue → 0
        target = (d + 1) % 10
        t = by_digit[target][0]
        redraw = render(intensity[t:t + 1], torch.tensor([c_src]))[0]
        sources.append(source); edits.append(redraw); prompts.append(redraw_instruction(d, target)); expected.append(1.0)
        mixed = redraw.clone()
        mixed[:, :, 8:] = render(intensity[t:t + 1, :, :, 8:], torch.tensor([(c_src + 3) % 6]))[0]
        sources.append(source); edits.append(mixed); prompts.append(redraw_instruction(d, target)); expected.append(0.0)
    out = fidelity(torch.stack(edits), prompts, source_images=torch.stack(sources))
    kept = out["digits_edit_strict_preservation"].view(10, 4)
    assert kept[:, 0].all() and kept[:, 2].all()
    assert kept[:, 1].mean() <= 0.2 and kept[:, 3].mean() <= 0.2
    # the class-level preservation forgives case 2 (same digit, another drawing): the strict reading does not
    assert out["digits_edit_gold_preservation"].view(10, 4)[:, 1].mean() >= 0.8
    # fidelity = success ∧ strict preservation ∧ real, per sample
    success = build_reward("digits_edit_gold")(torch.stack(edits), prompts, source_images=torch.stack(sources))["digits_edit_gold"].bool()
    parts = success & out["digits_edit_strict_preservation"].bool() & out["digits_real"].bool()
    assert torch.equal(out["digits_edit_fidelity"], parts.float())
    agree = (out["digits_edit_fidelity"] == torch.tensor(expected)).float().mean()
    assert agree >= 0.85, agree
    # a filled shape in the target colour: success by the judge perhaps, never fidelity
    blob = torch.zeros(1, 3, 16, 16, dtype=torch.uint8)
    blob[0, 0, 3:13, 4:12] = 255
    assert fidelity(blob, [recolour_instruction(0)], source_images=sources[0][None])["digits_edit_fidelity"].item() == 0.0
