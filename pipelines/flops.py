"""Analytic FLOPs of one denoiser forward, per architecture (pure functions of the model config).

Counts what ``torch.utils.flop_counter.FlopCounterMode`` counts — matrix products, convolutions and
attention (2 FLOPs per multiply-add) — from the model config, the number of latent (image) tokens and the
number of prompt tokens, for ONE sample and ONE conditional forward. Elementwise work (norms, activations,
RoPE) is not counted. A linear layer over ``n`` tokens costs ``2·n·d_in·d_out``; attention over ``S`` query
and ``S'`` key tokens of width ``D`` costs ``4·S·S'·D`` (``QKᵀ`` and ``AV``).

Each family's ``ModelAdapter.forward_flops`` picks its formula here: ``mmdit`` (SD3/SD3.5 and the digits
miniature), ``flux`` (FLUX.1 double and single blocks), ``qwen_image`` (Qwen-Image MMDiT), ``wan`` (Wan2.1
video DiT) and ``unet2d`` (SD1.5 and the digits epsilon UNet).
"""

from __future__ import annotations


def _linear(tokens: float, d_in: int, d_out: int) -> float:
    return 2.0 * tokens * d_in * d_out


def _attention(q_tokens: float, kv_tokens: float, dim: int) -> float:
    return 4.0 * q_tokens * kv_tokens * dim


def _lora(tokens: float, d_in: int, d_out: int, rank: int) -> float:
    return _linear(tokens, d_in, rank) + _linear(tokens, rank, d_out) if rank else 0.0


def _joint_attention_block(D: int, n: int, t: int, *, text_out: bool, lora_rank: int) -> float:
    """q/k/v of both streams, joint attention over n + t tokens, output projections (MMDiT / FLUX double)."""
    flops = 3 * _linear(n, D, D) + 3 * _linear(t, D, D) + _attention(n + t, n + t, D) + _linear(n, D, D)
    flops += 4 * _lora(n, D, D, lora_rank) + 3 * _lora(t, D, D, lora_rank)
    if text_out:
        flops += _linear(t, D, D) + _lora(t, D, D, lora_rank)
    return flops


def _double_stream_layers(D: int, n: int, t: int, layers: int, lora_rank: int) -> float:
    """FLUX double blocks / Qwen-Image blocks: per-stream 6D modulation, joint attention, 4× MLPs."""
    per = 2 * _linear(1, D, 6 * D) + _joint_attention_block(D, n, t, text_out=True, lora_rank=lora_rank)
    return layers * (per + 2 * _linear(n, D, 4 * D) + 2 * _linear(t, D, 4 * D))


def mmdit_forward_flops(config: dict, n_image: int, n_text: int, lora_rank: int = 0) -> float:
    """One sample through ``SD3Transformer2DModel`` (SD3, SD3.5 with dual attention, the digits model).

    ``n_image`` = latent tokens ``(H/p)·(W/p)``; ``n_text`` = prompt tokens. LoRA (``lora_rank`` > 0) on
    the attention projections of both streams (the diffrl default targets).
    """
    D = config["num_attention_heads"] * config["attention_head_dim"]
    p, c_in = config["patch_size"], config["in_channels"]
    c_out = config.get("out_channels") or c_in
    L = config["num_layers"]
    dual = set(config.get("dual_attention_layers") or ())
    n, t = n_image, n_text
    flops = _linear(n, c_in * p * p, D)  # patch embedding (a strided conv)
    flops += _linear(1, 256, D) + _linear(1, D, D) + _linear(1, config["pooled_projection_dim"], D) + _linear(1, D, D)
    flops += _linear(t, config["joint_attention_dim"], config["caption_projection_dim"])
    for i in range(L):
        last = i == L - 1
        flops += _linear(1, D, 9 * D if i in dual else 6 * D)  # AdaLayerNormZero(X) of the image stream
        flops += _linear(1, D, 2 * D if last else 6 * D)  # the text stream's norm
        flops += _joint_attention_block(D, n, t, text_out=not last, lora_rank=lora_rank)
        if i in dual:  # SD3.5's second, image-only attention
            flops += 4 * _linear(n, D, D) + _attention(n, n, D)
        flops += 2 * _linear(n, D, 4 * D)  # feed-forward (4× GELU MLP)
        if not last:
            flops += 2 * _linear(t, D, 4 * D)
    flops += _linear(1, D, 2 * D) + _linear(n, D, p * p * c_out)
    return flops


def flux_forward_flops(config: dict, n_image: int, n_text: int, lora_rank: int = 0) -> float:
    """One sample through ``FluxTransformer2DModel``: 2×2-packed latent tokens ``n_image``, T5 tokens ``n_text``."""
    D = config["num_attention_heads"] * config["attention_head_dim"]
    c_in = config["in_channels"]
    c_out = config.get("out_channels") or c_in
    p = config.get("patch_size", 1)
    n, t, s = n_image, n_text, n_image + n_text
    flops = _linear(n, c_in, D) + _linear(t, config["joint_attention_dim"], D)
    embedders = 3 if config.get("guidance_embeds") else 2  # timestep (+ guidance) 256→D→D, pooled P→D→D
    flops += (embedders - 1) * (_linear(1, 256, D) + _linear(1, D, D)) + _linear(1, config["pooled_projection_dim"], D) + _linear(1, D, D)
    flops += _double_stream_layers(D, n, t, config["num_layers"], lora_rank)
    mlp = int(D * config.get("mlp_ratio", 4.0))
    for _ in range(config["num_single_layers"]):
        flops += _linear(1, D, 3 * D) + 3 * _linear(s, D, D) + _attention(s, s, D) + _linear(s, D, mlp) + _linear(s, D + mlp, D)
        flops += 3 * _lora(s, D, D, lora_rank)
    flops += _linear(1, D, 2 * D) + _linear(n, D, p * p * c_out)
    return flops


def qwen_image_forward_flops(config: dict, n_image: int, n_text: int, lora_rank: int = 0) -> float:
    """One sample through ``QwenImageTransformer2DModel`` (MMDiT with per-stream modulation, packed latents)."""
    D = config["num_attention_heads"] * config["attention_head_dim"]
    c_in = config["in_channels"]
    c_out = config.get("out_channels") or c_in
    p = config["patch_size"]
    n, t = n_image, n_text
    flops = _linear(n, c_in, D) + _linear(t, config["joint_attention_dim"], D) + _linear(1, 256, D) + _linear(1, D, D)
    flops += _double_stream_layers(D, n, t, config["num_layers"], lora_rank)
    flops += _linear(1, D, 2 * D) + _linear(n, D, p * p * c_out)
    return flops


def wan_forward_flops(config: dict, n_image: int, n_text: int, lora_rank: int = 0) -> float:
    """One sample through ``WanTransformer3DModel`` (diffusers ``models/transformers/transformer_wan.py``).

    ``n_image`` = video tokens ``F_lat/p_t · H_lat/p_h · W_lat/p_w``; ``n_text`` = UMT5 tokens (the padded
    ``max_sequence_length``: WanPipeline passes every padded row, no attention mask). With ``D = heads·head_dim``:
    patch embedding (a strided 3-D conv) ``2·n·(C·p_t·p_h·p_w)·D``; the condition embedder (timestep
    ``freq_dim → D → D``, ``time_proj D → 6D``; text ``text_dim → D → D`` on every text token); per block
    self-attention ``4·2·n·D² + 4·n²·D``, cross-attention (q and out on the video tokens, k and v on the text
    tokens) ``2·2·n·D² + 2·2·t·D² + 4·n·t·D`` and the GELU feed-forward ``2·2·n·D·ffn_dim``; the output
    projection ``2·n·D·(C_out·p_t·p_h·p_w)``. LoRA (``lora_rank``) on to_q/to_k/to_v/to_out.0 of both
    attentions. An image-conditioned model's extra image tokens (I2V ``added_kv_proj_dim``) are not counted.
    """
    D = config["num_attention_heads"] * config["attention_head_dim"]
    patch = 1
    for p in config["patch_size"]:
        patch *= int(p)
    c_in = config["in_channels"]
    c_out = config.get("out_channels") or c_in
    n, t = n_image, n_text
    flops = _linear(n, c_in * patch, D)
    flops += _linear(1, config["freq_dim"], D) + _linear(1, D, D) + _linear(1, D, 6 * D)
    flops += _linear(t, config["text_dim"], D) + _linear(t, D, D)
    per_block = 4 * _linear(n, D, D) + _attention(n, n, D)  # self-attention
    per_block += 2 * _linear(n, D, D) + 2 * _linear(t, D, D) + _attention(n, t, D)  # cross-attention
    per_block += _linear(n, D, config["ffn_dim"]) + _linear(n, config["ffn_dim"], D)  # feed-forward
    per_block += 4 * _lora(n, D, D, lora_rank) + 2 * _lora(n, D, D, lora_rank) + 2 * _lora(t, D, D, lora_rank)
    flops += config["num_layers"] * per_block
    flops += _linear(n, D, c_out * patch)
    return flops


def _conv(pixels: float, c_in: int, c_out: int, kernel: int = 3) -> float:
    return 2.0 * pixels * c_in * c_out * kernel * kernel


def unet2d_forward_flops(config: dict, height: int, width: int, n_text: int, lora_rank: int = 0) -> float:
    """One sample through ``UNet2DConditionModel`` (SD1.5 layout: cross-attention blocks with one
    transformer layer each, resnets with 3×3 convs, strided-conv downsampling, nearest upsampling + conv).

    ``height``/``width`` are the latent's; ``n_text`` the prompt tokens.
    """
    ch = list(config["block_out_channels"])
    layers = config["layers_per_block"]
    cross = config["cross_attention_dim"]
    temb = ch[0] * 4
    down_types, up_types = config["down_block_types"], config["up_block_types"]
    c_in, c_out = config["in_channels"], config["out_channels"]

    def resnet(pixels, a, b):
        f = _conv(pixels, a, b) + _conv(pixels, b, b) + _linear(1, temb, b)
        return f + (_conv(pixels, a, b, 1) if a != b else 0.0)

    def transformer(pixels, c):
        f = 2 * _linear(pixels, c, c)  # proj_in / proj_out (linear projection in SD1.5's diffusers config)
        f += 4 * _linear(pixels, c, c) + _attention(pixels, pixels, c)  # self-attention
        f += 2 * _linear(pixels, c, c) + 2 * _linear(n_text, cross, c) + _attention(pixels, n_text, c)  # cross
        f += _linear(pixels, c, 8 * c) + _linear(pixels, 4 * c, c)  # GEGLU feed-forward
        f += 6 * _lora(pixels, c, c, lora_rank) + 2 * _lora(n_text, cross, c, lora_rank)
        return f

    h, w = height, width
    flops = _linear(1, ch[0], temb) + _linear(1, temb, temb) + _conv(h * w, c_in, ch[0])
    skips = [ch[0]]
    prev = ch[0]
    for i, block in enumerate(down_types):
        pixels = h * w
        for _ in range(layers):
            flops += resnet(pixels, prev, ch[i])
            if "CrossAttn" in block:
                flops += transformer(pixels, ch[i])
            prev = ch[i]
            skips.append(prev)
        if i < len(down_types) - 1:
            h, w = (h + 1) // 2, (w + 1) // 2
            flops += _conv(h * w, prev, prev)  # stride-2 conv: counted at the output resolution
            skips.append(prev)
    pixels = h * w
    flops += 2 * resnet(pixels, prev, prev) + transformer(pixels, prev)  # mid block
    rev = list(reversed(ch))
    for i, block in enumerate(up_types):
        pixels = h * w
        for _ in range(layers + 1):
            skip = skips.pop()
            flops += resnet(pixels, prev + skip, rev[i])
            if "CrossAttn" in block:
                flops += transformer(pixels, rev[i])
            prev = rev[i]
        if i < len(up_types) - 1:
            h, w = h * 2, w * 2
            flops += _conv(h * w, prev, prev)
    flops += _conv(h * w, prev, c_out)
    return flops
