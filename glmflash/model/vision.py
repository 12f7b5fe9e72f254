"""Vision tower: tubelets -> ViT blocks with 2-D RoPE -> 2x2 merge -> merger (spec §6.1-6.4).

Parameter names follow the checkpoint after the `model.visual.` prefix (spec §7.1); the two
convolutions keep their checkpoint shapes and run as linears on flattened inputs.
"""

from __future__ import annotations

import torch
from torch import nn

from glmflash.config import VisionConfig
from glmflash.model.layers import MLP, Linear, RMSNorm


class FlatConv(nn.Module):
    """A convolution whose kernel equals its stride and its input: a linear on the flattening."""

    def __init__(self, out_channels: int, kernel_shape: tuple[int, ...],
                 dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_channels, *kernel_shape, dtype=dtype),
                                   requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_channels, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x `[N, prod(kernel_shape)]` in the kernel's (channel, ...) order -> `[N, out]`."""
        return nn.functional.linear(x, self.weight.flatten(1), self.bias)


class VisionAttention(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h = config.hidden_size
        self.num_heads = config.num_heads
        self.head_dim = h // config.num_heads
        self.qkv = Linear(h, 3 * h, dtype, bias=config.attention_bias)
        self.proj = Linear(h, h, dtype, bias=config.attention_bias)
        self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps, dtype)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[tuple[int, int]]) -> torch.Tensor:
        """x `[N, h]`; attention is bidirectional inside each (count, length) run of segments."""
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)
        q = _rotate(self.q_norm(q), cos, sin)
        k = _rotate(self.k_norm(k), cos, sin)
        out, start = [], 0
        for count, length in segments:
            end = start + count * length
            # [count, heads, length, head_dim]: every segment of a run has the same length.
            qs, ks, vs = (t[start:end].view(count, length, self.num_heads, self.head_dim)
                          .transpose(1, 2) for t in (q, k, v))
            o = nn.functional.scaled_dot_product_attention(qs, ks, vs)
            out.append(o.transpose(1, 2).reshape(end - start, -1))
            start = end
        return self.proj(torch.cat(out))


class VisionBlock(nn.Module):
    def __init__(self, config: VisionConfig, dtype: torch.dtype) -> None:
        super().__init__()
        h = config.hidden_size
        self.norm1 = RMSNorm(h, config.rms_norm_eps, dtype)
        self.norm2 = RMSNorm(h, config.rms_norm_eps, dtype)
        self.attn = VisionAttention(config, dtype)
        self.mlp = MLP(h, config.intermediate_size, config.swiglu_limit, dtype, None,
                       bias=config.attention_bias)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                segments: list[tuple[int, int]]) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, segments)
        return x + self.mlp(self.norm2(x))


class PatchMerger(MLP):
    """Linear -> LayerNorm -> exact GELU -> clamped SwiGLU, all without biases but the norm's."""

    def __init__(self, dim: int, width: int, limit: float, dtype: torch.dtype) -> None:
        super().__init__(dim, width, limit, dtype, None)
        self.proj = Linear(dim, dim, dtype)
        self.post_projection_norm = nn.LayerNorm(dim, eps=1e-5, dtype=dtype)
        self.post_projection_norm.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(nn.functional.gelu(self.post_projection_norm(self.proj(x))))


class VisionTower(nn.Module):
    """Pixels of processed images/videos -> one embedding per merged 2x2 patch window."""

    def __init__(self, config: VisionConfig, out_hidden: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.config, self.dtype = config, dtype
        h, m, p = config.hidden_size, config.spatial_merge_size, config.patch_size
        self.patch_embed = nn.Module()
        self.patch_embed.proj = FlatConv(h, (config.in_channels, config.temporal_patch_size, p, p),
                                         dtype)
        self.blocks = nn.ModuleList(VisionBlock(config, dtype) for _ in range(config.depth))
        self.post_layernorm = RMSNorm(h, config.rms_norm_eps, dtype)
        self.downsample = FlatConv(out_hidden, (h, m, m), dtype)
        self.merger = PatchMerger(out_hidden, config.projection_intermediate_size,
                                  config.swiglu_limit, dtype)

    @torch.inference_mode()
    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values `[N, C*T*P*P]` (processor patch order), grid_thw `[M, 3]` -> `[N/m², D]`."""
        return self.features(pixel_values, grid_thw)

    def features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """`forward` outside inference mode (training takes gradients through it)."""
        grids = [tuple(int(v) for v in row) for row in grid_thw.tolist()]
        num_patches = sum(t * h * w for t, h, w in grids)
        if pixel_values.shape[0] != num_patches:
            raise ValueError(f"pixel_values has {pixel_values.shape[0]} rows but grid_thw "
                             f"{grids} describes {num_patches} patches")
        x = self.patch_embed.proj(pixel_values.to(self.dtype))
        cos, sin = self._rope(grids, x.device)
        # One run per image/video; each temporal slice (h*w patches) is its own segment.
        segments = [(t, h * w) for t, h, w in grids]
        for block in self.blocks:
            x = block(x, cos, sin, segments)
        x = self.post_layernorm(x)
        m = self.config.spatial_merge_size
        # Each m*m window is contiguous in row order (0,0),(0,1),(1,0),(1,1): conv input (h, m, m).
        x = x.view(-1, m, m, x.shape[-1]).permute(0, 3, 1, 2).flatten(1)
        return self.merger(self.downsample(x))

    def _rope(self, grids: list[tuple[int, int, int]], device: torch.device
              ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin `[N, head_dim]` (fp32): angles `[row·ν | col·ν | row·ν | col·ν]` (spec §6.2)."""
        head_dim = self.config.hidden_size // self.config.num_heads
        quarter = torch.arange(0, head_dim // 2, 2, dtype=torch.float32, device=device)
        inv_freq = 1.0 / self.config.rope_theta ** (quarter / (head_dim // 2))
        positions = torch.cat([_patch_positions(t, h, w, self.config.spatial_merge_size, device)
                               for t, h, w in grids])
        angles = (positions[..., None].float() * inv_freq).flatten(1)  # [N, head_dim / 2]
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()


def _patch_positions(t: int, h: int, w: int, merge: int, device: torch.device) -> torch.Tensor:
    """`[t*h*w, 2]` (row, col) of each patch in processor order: merge windows row-major."""
    rows = torch.arange(h, device=device).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge,
                                                                               merge)
    cols = torch.arange(w, device=device).view(1, 1, w // merge, merge).expand(h // merge, merge,
                                                                               -1, -1)
    # (block-row, in-row, block-col, in-col) -> (block-row, block-col, in-row, in-col)
    pos = torch.stack([rows, cols], dim=-1).permute(0, 2, 1, 3, 4).reshape(h * w, 2)
    return pos.repeat(t, 1)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE in fp32 on `[N, heads, head_dim]`, cast back to x's dtype."""
    xf = x.float()
    half = xf.shape[-1] // 2
    rotated = torch.cat([-xf[..., half:], xf[..., :half]], dim=-1)
    return (xf * cos[:, None] + rotated * sin[:, None]).to(x.dtype)

