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
