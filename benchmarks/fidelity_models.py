"""The two models of ``fidelity_time.py``, at the two ends of what makes an FSDP step slow on gloo ranks.

``deep``: 128 tiny residual blocks (LayerNorm, Linear(48, 48), GELU), a norm and a head, 259 modules and 516
params of 1.3 MB in all: a step is latency, per-group and per-op host work. ``wide``: 6 x Linear(2048, 2048), 100 MB of
fp32 params and a batch of 16 rows: a step is bytes through gloo.
"""

from __future__ import annotations

import torch
from torch import nn


def _loss(out: torch.Tensor) -> torch.Tensor:
    return out.pow(2).mean()


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.fc = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + nn.functional.gelu(self.fc(self.norm(x)))


class Deep(nn.Module):
    def __init__(self, blocks: int = 128, dim: int = 48) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(dim) for _ in range(blocks))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def deep() -> tuple[nn.Module, tuple[torch.Tensor], object]:
    return Deep(), (torch.randn(8, 48),), _loss


class Wide(nn.Module):
    def __init__(self, layers: int = 6, dim: int = 1024) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(dim, dim) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x


def wide() -> tuple[nn.Module, tuple[torch.Tensor], object]:
    return Wide(), (torch.randn(16, 1024),), _loss


# --- Attention variants and data-dependent routing (issue 26) ------------------------------------------------------
# Written the way users write them, for ``fidelity_memory.py --patterns``: multi-head latent attention (query/key
# heads of 96, value heads of 64, through F.scaled_dot_product_attention), an encoder built from
# nn.MultiheadAttention (need_weights=False: the call that takes SDPA's fused kernel), and a mixture of experts whose
# router picks each expert's tokens with torch.where (traced with the balanced stand-in, routing.py).

PATTERN_DIM, PATTERN_SEQ, PATTERN_BATCH = 256, 512, 4


class LatentAttention(nn.Module):
    """DeepSeek-style MLA: keys and values from a compressed latent; query/key heads wider than value heads."""

    def __init__(self, dim: int = PATTERN_DIM, heads: int = 4, latent: int = 64, qk_head: int = 96,
                 v_head: int = 64) -> None:
        super().__init__()
        self.heads, self.qk_head, self.v_head = heads, qk_head, v_head
        self.q = nn.Linear(dim, heads * qk_head, bias=False)
        self.down = nn.Linear(dim, latent, bias=False)
        self.norm = nn.LayerNorm(latent)
        self.k = nn.Linear(latent, heads * qk_head, bias=False)
        self.v = nn.Linear(latent, heads * v_head, bias=False)
        self.out = nn.Linear(heads * v_head, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        c = self.norm(self.down(x))
        q = self.q(x).view(b, s, self.heads, self.qk_head).transpose(1, 2)
        k = self.k(c).view(b, s, self.heads, self.qk_head).transpose(1, 2)
        v = self.v(c).view(b, s, self.heads, self.v_head).transpose(1, 2)
        o = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(o.transpose(1, 2).reshape(b, s, self.heads * self.v_head))


class PatternBlock(nn.Module):
    """Pre-norm residual block around ``mixer`` and an MLP (a where-routed MoE when ``moe``)."""

    def __init__(self, mixer: str, moe: bool = False, dim: int = PATTERN_DIM) -> None:
        super().__init__()
        self.mixer_kind = mixer
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.mixer = LatentAttention(dim) if mixer == "mla" else nn.MultiheadAttention(dim, 4, batch_first=True)
        self.mlp = WhereMoE(dim) if moe else nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.norm1(x)
        x = x + (self.mixer(y) if self.mixer_kind == "mla" else self.mixer(y, y, y, need_weights=False)[0])
        return x + self.mlp(self.norm2(x))


class WhereMoE(nn.Module):
    """Top-2 of 4 experts; each expert's tokens picked with torch.where, outputs added back with index_add."""

    def __init__(self, dim: int = PATTERN_DIM, experts: int = 4, top_k: int = 2) -> None:
        super().__init__()
        self.top_k = top_k
        self.gate = nn.Linear(dim, experts, bias=False)
        self.experts = nn.ModuleList(nn.Sequential(nn.Linear(dim, 2 * dim), nn.SiLU(), nn.Linear(2 * dim, dim))
                                     for _ in range(experts))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.softmax(self.gate(tokens), dim=-1).topk(self.top_k, dim=-1)
        out = torch.zeros_like(tokens)
        for e, expert in enumerate(self.experts):
            rows, slot = torch.where(chosen == e)
            out = out.index_add(0, rows, expert(tokens[rows]) * weights[rows, slot, None])
        return out.view_as(x)


class PatternNet(nn.Module):
    def __init__(self, mixer: str, moe: bool = False, layers: int = 4, dim: int = PATTERN_DIM) -> None:
        super().__init__()
        self.embed = nn.Embedding(512, dim)
        self.blocks = nn.ModuleList(PatternBlock(mixer, moe, dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, 512)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def _ids() -> tuple[torch.Tensor]:
    return (torch.randint(0, 512, (PATTERN_BATCH, PATTERN_SEQ)),)


def mla() -> tuple[nn.Module, tuple[torch.Tensor], object]:
    return PatternNet("mla"), _ids(), _loss


def mha_encoder() -> tuple[nn.Module, tuple[torch.Tensor], object]:
    return PatternNet("mha"), _ids(), _loss


def where_moe() -> tuple[nn.Module, tuple[torch.Tensor], object]:
    return PatternNet("mha", moe=True), _ids(), _loss


# --- Issue 26: memory on models it was not tuned on (fidelity_memory.py's ISSUE26_CASES) ------------------------
# conv_bn: a ResNet-style conv net with BatchNorm; qwen3_small / qwen3_cache: a Qwen3-style Hugging Face decoder
# (transformers' RMSNorm, which computes in fp32), without and with the KV cache; whisper_small: a Whisper-style
# encoder-decoder. Sizes keep a fake-world run around a second on 2 cores.

QWEN3_SMALL = {"model_type": "qwen3", "vocab_size": 4096, "hidden_size": 256, "intermediate_size": 768,
               "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32,
               "max_position_embeddings": 1024, "tie_word_embeddings": False}


class ConvBlock(nn.Module):
    """conv-BN-ReLU-conv-BN plus the input: BatchNorm keeps fp32 running stats as buffers."""

    def __init__(self, channels: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(channels)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))


class ConvBN(nn.Module):
    def __init__(self, channels: int = 64, blocks: int = 4, classes: int = 10) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels),
                                  nn.ReLU())
        self.blocks = nn.ModuleList(ConvBlock(channels) for _ in range(blocks))
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x.mean(dim=(2, 3)))


def conv_bn(batch_size: int = 16) -> tuple[nn.Module, tuple[torch.Tensor], object]:
    return ConvBN(), (torch.randn(batch_size, 3, 32, 32),), _loss


def qwen3_small(batch_size: int = 2, seq_len: int = 512) -> tuple:
    from fsdp_planner.models import hf

    return hf.build_causal_lm(QWEN3_SMALL, batch_size, seq_len)


def qwen3_cache(batch_size: int = 2, seq_len: int = 512) -> tuple:
    """qwen3_small with ``--hf-config use_cache=true``: every layer's keys and values stay in the cache."""
    from fsdp_planner.models import hf

    return hf.build_causal_lm(QWEN3_SMALL, batch_size, seq_len, (("use_cache", True),))


def whisper_small(batch_size: int = 2) -> tuple:
    """Whisper's architecture at a small size: 128 mel frames (64 after the encoder's stride-2 conv), 32 target
    tokens; the model's own loss, no KV cache (a training step), transformers' packed-sequence check answered as
    for ``hf:`` models (``hf.unpacked_inputs``)."""
    from transformers import WhisperConfig, WhisperForConditionalGeneration

    from fsdp_planner.models import hf

    hf.unpacked_inputs()
    cfg = WhisperConfig(vocab_size=4096, d_model=256, encoder_layers=4, decoder_layers=4, encoder_attention_heads=8,
                        decoder_attention_heads=8, encoder_ffn_dim=1024, decoder_ffn_dim=1024, num_mel_bins=80,
                        max_source_positions=64, max_target_positions=64, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2, decoder_start_token_id=1, use_cache=False)
    model = WhisperForConditionalGeneration(cfg).train()
    features = torch.randn(batch_size, 80, 128)
    labels = torch.randint(3, 4096, (batch_size, 32))
    return model, {"input_features": features, "labels": labels}, lambda out: out.loss
# --- end of issue 26's section ----------------------------------------------------------------------------------


# --- Issue 39: held-out architectures and Hugging Face decoder families (fidelity_memory.py --heldout) ------------
# Hugging Face models built here from transformers' config classes (tiny sizes, SDPA attention, no KV cache, the
# model's own next-token loss on its logits), and three models written for this table, one per held-out pattern:
# a Swin-like windowed-attention model, a U-Net with attention blocks and a Mamba-like selective-scan SSM. Both
# the product (``load_model``) and benchmarks/independent_memory.py build them from these functions.

HELDOUT_BATCH, HELDOUT_SEQ, HELDOUT_VOCAB = 2, 512, 4096
_DECODER = {"vocab_size": HELDOUT_VOCAB, "hidden_size": 256, "num_hidden_layers": 4, "num_attention_heads": 8,
            "max_position_embeddings": 1024, "use_cache": False}


def _hf_causal_lm(config_class: str, **fields: object) -> tuple:
    import transformers

    from fsdp_planner.models import hf

    hf.unpacked_inputs()  # transformers' packed-sequence check on fake tensors (real ones are asked as before)
    config = getattr(transformers, config_class)(**{**_DECODER, **fields})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    ids = torch.randint(0, HELDOUT_VOCAB, (HELDOUT_BATCH, HELDOUT_SEQ))
    return model, {"input_ids": ids}, lambda out: model.loss_function(out.logits, ids, vocab_size=HELDOUT_VOCAB)


def gpt_neox() -> tuple:
    return _hf_causal_lm("GPTNeoXConfig", intermediate_size=1024)


def falcon() -> tuple:  # Falcon-7B's layout: parallel attention and MLP, multi-query attention
    return _hf_causal_lm("FalconConfig", new_decoder_architecture=False, multi_query=True, parallel_attn=True,
                         alibi=False, bias=False)


def granite() -> tuple:
    return _hf_causal_lm("GraniteConfig", intermediate_size=768, num_key_value_heads=4)


def stablelm() -> tuple:
    return _hf_causal_lm("StableLmConfig", intermediate_size=768, num_key_value_heads=8)


def starcoder2() -> tuple:
    return _hf_causal_lm("Starcoder2Config", intermediate_size=1024, num_key_value_heads=2,
                         bos_token_id=None, eos_token_id=None)


def qwen2_tied() -> tuple:
    return _hf_causal_lm("Qwen2Config", intermediate_size=768, num_key_value_heads=4, tie_word_embeddings=True)


def bart() -> tuple:
    """A BART-style encoder-decoder: 512 source tokens, 128 target tokens, the model's own loss."""
    import transformers

    config = transformers.BartConfig(vocab_size=HELDOUT_VOCAB, d_model=256, encoder_layers=3, decoder_layers=3,
                                     encoder_attention_heads=8, decoder_attention_heads=8, encoder_ffn_dim=1024,
                                     decoder_ffn_dim=1024, max_position_embeddings=1024, use_cache=False)
    model = transformers.BartForConditionalGeneration._from_config(config, attn_implementation="sdpa").train()
    ids = torch.randint(3, HELDOUT_VOCAB, (HELDOUT_BATCH, HELDOUT_SEQ))
    labels = torch.randint(3, HELDOUT_VOCAB, (HELDOUT_BATCH, HELDOUT_SEQ // 4))
    return model, {"input_ids": ids, "labels": labels}, lambda out: out.loss


class WindowAttention(nn.Module):
    """Self-attention inside non-overlapping windows of ``window`` x ``window`` tokens; with ``shift``, the map is
    rolled by half a window first (and back after), and tokens that the roll brought together from opposite edges
    are kept apart by a mask."""

    def __init__(self, dim: int, heads: int, window: int, size: int, shift: bool) -> None:
        super().__init__()
        self.heads, self.window, self.shift = heads, window, window // 2 if shift else 0
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)
        self.register_buffer("mask", _shift_mask(size, window, self.shift), persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # x: (batch, height, width, dim)
        b, h, w, _ = x.shape
        if self.shift:
            x = torch.roll(x, (-self.shift, -self.shift), dims=(1, 2))
        win = _partition(x, self.window)  # (batch * windows, window * window, dim)
        q, k, v = self.qkv(win).view(win.shape[0], win.shape[1], 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        mask = self.mask.repeat(b, 1, 1).unsqueeze(1) if self.shift else None
        o = nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        out = _merge(self.proj(o.transpose(1, 2).reshape(win.shape)), self.window, b, h, w)
        return torch.roll(out, (self.shift, self.shift), dims=(1, 2)) if self.shift else out


def _partition(x: torch.Tensor, window: int) -> torch.Tensor:
    b, h, w, d = x.shape
    x = x.view(b, h // window, window, w // window, window, d).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, window * window, d)


def _merge(win: torch.Tensor, window: int, b: int, h: int, w: int) -> torch.Tensor:
    x = win.view(b, h // window, w // window, window, window, -1).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(b, h, w, -1)


def _shift_mask(size: int, window: int, shift: int) -> torch.Tensor:
    """(windows, tokens, tokens): True where two tokens of a rolled window came from the same region."""
    if not shift:
        return torch.ones(1, 1, 1, dtype=torch.bool)
    region = torch.zeros(1, size, size, 1)
    bounds = (slice(0, -window), slice(-window, -shift), slice(-shift, None))
    for i, rows in enumerate(bounds):
        for j, cols in enumerate(bounds):
            region[:, rows, cols, :] = 3 * i + j
    labels = _partition(region, window).squeeze(-1)
    return labels.unsqueeze(1) == labels.unsqueeze(2)


class SwinBlock(nn.Module):
    def __init__(self, dim: int, heads: int, window: int, size: int, shift: bool) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, heads, window, size, shift)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class PatchMerging(nn.Module):
    """Each 2 x 2 neighbourhood's four tokens concatenated and projected: half the size, twice the channels."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(4 * dim)
        self.reduce = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.cat([x[:, i::2, j::2] for i in (0, 1) for j in (0, 1)], dim=-1)
        return self.reduce(self.norm(x))


class SwinNet(nn.Module):
    """Patch embedding (4 x 4), two stages of (plain, shifted) window-attention blocks with a patch merging
    between them, a pooled classifier. A 64 x 64 image: 16 x 16 tokens of 96 channels, then 8 x 8 of 192."""

    def __init__(self, dim: int = 96, window: int = 4, depths: tuple[int, ...] = (2, 2), classes: int = 100) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 4, stride=4)
        self.blocks = nn.ModuleList()
        size = 16
        for stage, depth in enumerate(depths):
            if stage:
                self.blocks.append(PatchMerging(dim))
                dim, size = 2 * dim, size // 2
            self.blocks.extend(SwinBlock(dim, dim // 32, window, size, shift=bool(i % 2)) for i in range(depth))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x).permute(0, 2, 3, 1)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x).mean(dim=(1, 2)))


def swin() -> tuple:
    return SwinNet(), (torch.randn(8, 3, 64, 64),), _loss


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int) -> None:
        super().__init__()
        self.norm1, self.norm2 = nn.GroupNorm(8, cin), nn.GroupNorm(8, cout)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1)
        self.skip = nn.Conv2d(cin, cout, 1) if cin != cout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.conv1(nn.functional.silu(self.norm1(x)))
        return self.skip(x) + self.conv2(nn.functional.silu(self.norm2(h)))


class SpatialAttention(nn.Module):
    """Self-attention over a feature map's positions (GroupNorm, 1 x 1 convs for q, k, v and out), residual."""

    def __init__(self, channels: int, heads: int = 4) -> None:
        super().__init__()
        self.heads = heads
        self.norm = nn.GroupNorm(8, channels)
        self.qkv = nn.Conv2d(channels, 3 * channels, 1)
        self.out = nn.Conv2d(channels, channels, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        q, k, v = self.qkv(self.norm(x)).view(b, 3, self.heads, c // self.heads, h * w).transpose(-1, -2).unbind(1)
        o = nn.functional.scaled_dot_product_attention(q, k, v)
        return x + self.out(o.transpose(-1, -2).reshape(b, c, h, w))


class UNetLevel(nn.Module):
    """A resolution's block: a residual block, attention at the lower resolutions."""

    def __init__(self, cin: int, cout: int, attention: bool) -> None:
        super().__init__()
        self.res = ResBlock(cin, cout)
        self.attn = SpatialAttention(cout) if attention else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.attn(self.res(x))


class AttentionUNet(nn.Module):
    """Three resolutions down (stride-2 convs), a middle level, three up (nearest upsampling, the skip
    concatenated); attention at 16 x 16 and 8 x 8. A 32 x 32 input; the loss is the output's mean square."""

    def __init__(self, widths: tuple[int, ...] = (64, 128, 256)) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, widths[0], 3, padding=1)
        self.down = nn.ModuleList(UNetLevel(w if i == 0 else widths[i - 1], w, attention=i > 0)
                                  for i, w in enumerate(widths))
        self.pool = nn.ModuleList(nn.Conv2d(w, w, 3, stride=2, padding=1) for w in widths[:-1])
        self.middle = UNetLevel(widths[-1], widths[-1], attention=True)
        ups = list(reversed(widths))
        self.up = nn.ModuleList(UNetLevel(2 * w, ups[i + 1] if i + 1 < len(ups) else w, attention=i < 2)
                                for i, w in enumerate(ups))
        self.head = nn.Conv2d(widths[0], 3, 3, padding=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x, skips = self.stem(x), []
        for i, level in enumerate(self.down):
            x = level(x)
            skips.append(x)
            if i < len(self.pool):
                x = self.pool[i](x)
        x = self.middle(x)
        for i, level in enumerate(self.up):
            if i:
                x = nn.functional.interpolate(x, scale_factor=2.0, mode="nearest")
            x = level(torch.cat([x, skips.pop()], dim=1))
        return self.head(x)


def unet_attention() -> tuple:
    return AttentionUNet(), (torch.randn(4, 3, 32, 32),), _loss


class SelectiveScan(nn.Module):
    """A Mamba-style mixer in plain torch ops: input projection to (x, z), a causal depthwise conv over the
    sequence, an input-dependent step size dt and projections B, C, the scan h_t = exp(dt_t A) h_{t-1} +
    dt_t B_t x_t, y_t = C_t h_t + D x_t written as a loop over positions, gated by silu(z), projected out."""

    def __init__(self, dim: int, expand: int = 2, state: int = 16, conv: int = 4, rank: int = 16) -> None:
        super().__init__()
        inner = expand * dim
        self.state, self.rank = state, rank
        self.in_proj = nn.Linear(dim, 2 * inner, bias=False)
        self.conv = nn.Conv1d(inner, inner, conv, groups=inner, padding=conv - 1)
        self.x_proj = nn.Linear(inner, rank + 2 * state, bias=False)
        self.dt_proj = nn.Linear(rank, inner)
        self.a_log = nn.Parameter(torch.log(torch.arange(1, state + 1, dtype=torch.float32)).repeat(inner, 1))
        self.d = nn.Parameter(torch.ones(inner))
        self.out_proj = nn.Linear(inner, dim, bias=False)

    def forward(self, u: torch.Tensor) -> torch.Tensor:
        seq = u.shape[1]
        x, z = self.in_proj(u).chunk(2, dim=-1)
        x = nn.functional.silu(self.conv(x.transpose(1, 2))[..., :seq].transpose(1, 2))
        dt, b, c = self.x_proj(x).split([self.rank, self.state, self.state], dim=-1)
        dt = nn.functional.softplus(self.dt_proj(dt))
        decay = torch.exp(dt.unsqueeze(-1) * -torch.exp(self.a_log))  # (batch, seq, inner, state)
        drive = dt.unsqueeze(-1) * b.unsqueeze(2) * x.unsqueeze(-1)
        h, ys = torch.zeros_like(drive[:, 0]), []
        for t in range(seq):
            h = decay[:, t] * h + drive[:, t]
            ys.append((h * c[:, t].unsqueeze(1)).sum(-1))
        y = torch.stack(ys, dim=1) + x * self.d
        return self.out_proj(y * nn.functional.silu(z))


class MambaBlock(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.mixer = SelectiveScan(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mixer(self.norm(x))


class MambaLM(nn.Module):
    def __init__(self, dim: int = 128, layers: int = 4, vocab: int = 1024) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(MambaBlock(dim) for _ in range(layers))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def mamba() -> tuple:
    ids = torch.randint(0, 1024, (4, 48))
    return MambaLM(), (ids,), lambda logits: nn.functional.cross_entropy(logits.float().flatten(0, 1),
                                                                        ids.flatten())
# --- end of issue 39's section ----------------------------------------------------------------------------------
