"""InternViT for MMSegmentation 1.x: one class from test sizes up to 6B.

The published InternViT-6B (InternVL) is a plain ViT with a few choices of
its own: RMSNorm blocks, query/key normalisation over the full width,
LayerScale on both residual branches, no qkv bias, patch size 14 and a class
token with absolute position embeddings for a 16 x 16 pre-training grid.
Module names follow the public checkpoints (``blocks.{i}.attn.qkv``,
``blocks.{i}.ls1.gamma``, ``patch_embed.proj`` ...), so they load as is.
"""
import logging
import math
from typing import Optional, Sequence

import torch
import torch.nn.functional as F
import torch.utils.checkpoint as cp
from mmengine.logging import print_log
from mmengine.model import BaseModule
from mmseg.registry import MODELS
from torch import nn

from .intern_vit_checkpoint import (convert_checkpoint,
                                    load_internvit_checkpoint)

__all__ = [
    'InternViT', 'InternViTBlock', 'resize_patch_kernel', 'resize_pos_embed'
]

# What ``InternViT(dtype=...)`` accepts; fp16 is left out on purpose: its
# range (65504) is too small for un-scaled training.
_DTYPES = {'float32': torch.float32, 'bfloat16': torch.bfloat16}


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """Where precision-sensitive steps (interpolation, the channel norm,
    the features handed to the heads) run: fp32 for bf16 / fp16, but never
    below the tensor's own, so a float64 model stays float64 throughout
    (what ``.double()`` is for: checking numerics)."""
    return torch.promote_types(dtype, torch.float32)


def resize_pos_embed(pos_embed: torch.Tensor, new_grid: int) -> torch.Tensor:
    """Resize ``(1, 1 + g*g, C)`` position embeddings to ``new_grid``.

    The class token's embedding is kept; the grid part is interpolated
    bicubically, as ViT fine-tuning at a new resolution does.
    """
    cls_pos, grid_pos = pos_embed[:, :1], pos_embed[:, 1:]
    old_grid = int(math.isqrt(grid_pos.shape[1]))
    if old_grid * old_grid != grid_pos.shape[1]:
        raise ValueError('position embeddings should cover a square grid '
                         f'plus a class token, but got {pos_embed.shape[1]}')
    if old_grid == new_grid:
        return pos_embed
    dim = grid_pos.shape[-1]
    grid_pos = grid_pos.reshape(1, old_grid, old_grid, dim).permute(0, 3, 1, 2)
    grid_pos = F.interpolate(
        grid_pos.to(_compute_dtype(grid_pos.dtype)),
        size=(new_grid, new_grid),
        mode='bicubic',
        align_corners=False).to(pos_embed.dtype)
    grid_pos = grid_pos.permute(0, 2, 3, 1).reshape(1, new_grid * new_grid,
                                                    dim)
    return torch.cat([cls_pos, grid_pos], dim=1)


class _LayerScale(nn.Module):

    def __init__(self, dim: int, init_value: float) -> None:
        super().__init__()
        self.gamma = nn.Parameter(torch.full((dim, ), init_value))

    def forward(self, x):
        return x * self.gamma


class _ChannelNorm(nn.Module):
    """LayerNorm over the channels of ``(B, C, H, W)`` maps, in fp32.

    InternVL's pyramid normalises this way (eps 1e-6) and casts back to the
    input's dtype, so a bf16 backbone still normalises in fp32 (a float64
    one in float64: see ``_compute_dtype``).
    """

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x):
        dtype = _compute_dtype(x.dtype)
        out = F.layer_norm(
            x.to(dtype).permute(0, 2, 3, 1), self.weight.shape,
            self.weight.to(dtype), self.bias.to(dtype), self.eps)
        return out.permute(0, 3, 1, 2).to(x.dtype)


def resize_patch_kernel(weight: torch.Tensor, patch_size: int) -> torch.Tensor:
    """Resize a ``(C, 3, k, k)`` patch-embedding kernel bicubically.

    InternVL loads a 16 x 16 kernel into a patch-14 model this way.
    """
    if weight.shape[-2:] == (patch_size, patch_size):
        return weight
    return F.interpolate(
        weight.to(_compute_dtype(weight.dtype)),
        size=(patch_size, patch_size),
        mode='bicubic',
        align_corners=False).to(weight.dtype)


class _DropPath(nn.Module):
    """Stochastic depth: drop the whole residual branch per sample."""

    def __init__(self, prob: float) -> None:
        super().__init__()
        self.prob = prob

    def forward(self, x):
        if self.prob == 0 or not self.training:
            return x
        keep = x.new_empty((x.shape[0], ) + (1, ) * (x.dim() - 1))
        keep.bernoulli_(1 - self.prob)
        return x * keep / (1 - self.prob)


def _norm(kind: str, dim: int, eps: float) -> nn.Module:
    if kind == 'rms':
        return nn.RMSNorm(dim, eps=eps)
    if kind == 'ln':
        return nn.LayerNorm(dim, eps=eps)
    raise ValueError(f"norm should be 'rms' or 'ln', but got {kind!r}")


class _Attention(nn.Module):

    def __init__(self, dim, num_heads, qkv_bias, qk_norm, norm, eps):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f'embed_dims {dim} should be divisible by '
                             f'num_heads {num_heads}')
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.qk_norm = qk_norm
        if qk_norm:
            # Over the full width, before the heads are split.
            self.q_norm = _norm(norm, dim, eps)
            self.k_norm = _norm(norm, dim, eps)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, c = x.shape
        # The public qkv weight stacks q, k and v along its output.
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (
            t.reshape(b, n, self.num_heads, -1).transpose(1, 2)
            for t in (q, k, v))
        x = F.scaled_dot_product_attention(q, k, v)
        return self.proj(x.transpose(1, 2).reshape(b, n, c))


class _Mlp(nn.Module):

    def __init__(self, dim, hidden):
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.act = nn.GELU()
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class InternViTBlock(nn.Module):
    """One pre-norm transformer block of :class:`InternViT` (attention and
    MLP, each with LayerScale and stochastic depth). Public so that
    sharding policies can name it (``FSDP2Strategy(shard_modules=...)``)."""

    def __init__(self, dim, num_heads, mlp_hidden, qkv_bias, qk_norm, norm,
                 eps, init_values, drop_path):
        super().__init__()
        self.norm1 = _norm(norm, dim, eps)
        self.attn = _Attention(dim, num_heads, qkv_bias, qk_norm, norm, eps)
        self.ls1 = _LayerScale(dim, init_values)
        self.norm2 = _norm(norm, dim, eps)
        self.mlp = _Mlp(dim, mlp_hidden)
        self.ls2 = _LayerScale(dim, init_values)
        self.drop_path = _DropPath(drop_path)

    def forward(self, x):
        x = x + self.drop_path(self.ls1(self.attn(self.norm1(x))))
        return x + self.drop_path(self.ls2(self.mlp(self.norm2(x))))


class _PatchEmbed(nn.Module):

    def __init__(self, patch_size, in_channels, dim):
        super().__init__()
        self.proj = nn.Conv2d(in_channels, dim, patch_size, patch_size)

    def forward(self, x):
        return self.proj(x)


@MODELS.register_module()
class InternViT(BaseModule):
    """InternViT backbone (InternViT-6B / -300M and anything smaller).

    Defaults are InternViT-6B's. InternViT-300M: ``embed_dims=1024,
    depth=24, num_heads=16, mlp_ratio=4, qkv_bias=True, qk_norm=False,
    norm='ln'``.

    Args:
        img_size (int): Training resolution; position embeddings are resized
            from the pre-training grid to ``img_size // patch_size``.
            Defaults to 224.
        patch_size (int): Defaults to 14.
        in_channels (int): Defaults to 3.
        embed_dims (int): Width. Defaults to 3200.
        depth (int): Number of blocks. Defaults to 48.
        num_heads (int): Defaults to 25.
        mlp_ratio (float): MLP width over ``embed_dims``. Defaults to 4.
        qkv_bias (bool): Defaults to False.
        qk_norm (bool): Normalise q and k over the full width. Defaults to
            True.
        norm (str): ``'rms'`` (RMSNorm) or ``'ln'`` (LayerNorm). Defaults to
            ``'rms'``.
        norm_eps (float): Defaults to 1e-6.
        init_values (float): LayerScale initial value. Defaults to 0.1.
        drop_path_rate (float): Stochastic depth of the last block, rising
            linearly from 0. Defaults to 0.
        pretrain_size (int): Resolution of the pre-training grid of the
            position embeddings (checkpoints store that grid). Defaults to
            224.
        out_indices (Sequence[int]): Blocks whose outputs are returned, as
            ``(B, C, H / 14, W / 14)`` maps. Defaults to ``(47, )``.
        with_fpn (bool): Turn four outputs into four scales (x4, x2, x1,
            /2) for UperNet, as InternVL does: ``up1`` = transposed
            convolution, channel LayerNorm (fp32), GELU, transposed
            convolution; ``up2`` = transposed convolution; ``up3`` =
            identity; ``up4`` = max-pooling. Needs four ``out_indices``.
            Defaults to False.
        with_final_norm (bool): A channel LayerNorm after each scale of the
            pyramid (InternVL's ``with_final_norm``). Defaults to False.
        with_cp (bool): Activation checkpointing per block while training.
            Defaults to False.
        freeze (bool): No parameter of the pre-trained ViT takes gradients
            (linear probing, head tuning) and its blocks stay in eval mode;
            the pyramid of ``with_fpn``, new, still trains. Defaults to
            False.
        pretrained (str, optional): Path of a checkpoint, loaded by
            ``init_weights``: ``.pth``, ``.bin`` or ``.safetensors``, in any
            layout of :mod:`.intern_vit_checkpoint` (ours / InternVL's
            backbone, Hugging Face, InternVL-Chat ``vision_model.``, a whole
            segmentor). Defaults to None.
        allow_partial (bool): Let ``pretrained`` leave parameters of the
            pre-trained ViT unloaded, or carry tensors the backbone does not
            have, with a WARNING; by default that is an error, since
            training would start from random weights. Defaults to False.
        dtype (str): ``'float32'`` or ``'bfloat16'``: the initial dtype of
            the backbone's parameters, hence of their gradients and of the
            DDP buckets that carry them. ``'bfloat16'`` trains the backbone
            in bf16 as InternVL does, while the heads stay fp32. Cast here,
            at construction, because DDP fixes its buckets' dtype when
            MMEngine wraps the model, before any runner hook could cast it.
            ``forward`` reads the dtype again on every call (see
            :attr:`dtype`), so a later ``.to()``, ``.half()``,
            ``.double()`` or FSDP2's ``param_dtype`` is followed; features
            leave in fp32 (float64 from float64 parameters). Why, and what
            the hooks do with bf16 buckets:
            ``docs/en/design/bf16_backbone.md``. Defaults to
            ``'float32'``.
        init_cfg (dict, optional): MMEngine's init, applied before
            ``pretrained`` is loaded, so with a checkpoint it reaches the
            new parts only; e.g. InternVL's init of the pyramid is
            ``dict(type='Kaiming', layer='ConvTranspose2d', mode='fan_out',
            nonlinearity='relu', distribution='normal')``. Defaults to
            None (PyTorch's own init).
    """

    def __init__(self,
                 img_size: int = 224,
                 patch_size: int = 14,
                 in_channels: int = 3,
                 embed_dims: int = 3200,
                 depth: int = 48,
                 num_heads: int = 25,
                 mlp_ratio: float = 4.,
                 qkv_bias: bool = False,
                 qk_norm: bool = True,
                 norm: str = 'rms',
                 norm_eps: float = 1e-6,
                 init_values: float = 0.1,
                 drop_path_rate: float = 0.,
                 pretrain_size: int = 224,
                 out_indices: Sequence[int] = (47, ),
                 with_fpn: bool = False,
                 with_final_norm: bool = False,
                 with_cp: bool = False,
                 freeze: bool = False,
                 pretrained: Optional[str] = None,
                 allow_partial: bool = False,
                 dtype: str = 'float32',
                 init_cfg: Optional[dict] = None) -> None:
        super().__init__(init_cfg=init_cfg)
        if dtype not in _DTYPES:
            raise ValueError(f'dtype should be one of {sorted(_DTYPES)}, '
                             f'but got {dtype!r}')
        out_indices = tuple(out_indices)
        bad = [i for i in out_indices if not -depth <= i < depth]
        if bad:
            raise ValueError(f'out_indices should be block indices below '
                             f'depth {depth}, but got {bad}')
        if with_final_norm and not with_fpn:
            raise ValueError('with_final_norm normalises the outputs of '
                             'the pyramid, so it needs with_fpn=True')
        if with_fpn and len(out_indices) != 4:
            raise ValueError('with_fpn needs four out_indices (one per '
                             f'scale), but got {out_indices}')
        if img_size % patch_size:
            raise ValueError(f'img_size {img_size} should be a multiple of '
                             f'patch_size {patch_size}')
        self.patch_size = patch_size
        self.grid = img_size // patch_size
        self.out_indices = tuple(i % depth for i in out_indices)
        self.with_cp = with_cp
        self.freeze = freeze
        self.pretrained = pretrained
        self.allow_partial = allow_partial

        self.patch_embed = _PatchEmbed(patch_size, in_channels, embed_dims)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dims))
        self.pos_embed = nn.Parameter(
            torch.zeros(1, 1 + self.grid * self.grid, embed_dims))
        self._pretrain_grid = pretrain_size // patch_size
        # Plain Python: the 6B model is built on the meta device to count it.
        rates = [drop_path_rate * i / max(depth - 1, 1) for i in range(depth)]
        hidden = int(embed_dims * mlp_ratio)
        self.blocks = nn.ModuleList(
            InternViTBlock(embed_dims, num_heads, hidden, qkv_bias, qk_norm,
                           norm, norm_eps, init_values, rate)
            for rate in rates)

        self.with_fpn = with_fpn
        if with_fpn:
            # InternVL's pyramid, index for index, so that the ``up1``..
            # ``up4`` keys of its segmentation checkpoints load as they are;
            # the last entry of each is the optional final norm.
            def final():
                return (_ChannelNorm(embed_dims)
                        if with_final_norm else nn.Identity())

            self.up1 = nn.Sequential(
                nn.ConvTranspose2d(embed_dims, embed_dims, 2, 2),
                _ChannelNorm(embed_dims), nn.GELU(),
                nn.ConvTranspose2d(embed_dims, embed_dims, 2, 2), final())
            self.up2 = nn.Sequential(
                nn.ConvTranspose2d(embed_dims, embed_dims, 2, 2), final())
            self.up3 = nn.Sequential(nn.Identity(), final())
            self.up4 = nn.Sequential(nn.MaxPool2d(2), final())
            # PyTorch's default init unless ``init_cfg`` says otherwise:
            # the 6B recipes ask for InternVL's He-normal over the fan-out
            # (``_base_/models/upernet_intern-vit-6b.py``); the tiny toy
            # recipe, trained from scratch, keeps the default, which
            # trains it better (docs/en/user_guides/intern_vit.md).
        if freeze:
            for param in self.vit_parameters():
                param.requires_grad_(False)
        if _DTYPES[dtype] is not torch.float32:
            # Here, before MMEngine wraps the model in DDP (see ``dtype``).
            # Weights loaded or initialised later are written in place, so
            # they keep this dtype.
            self.to(_DTYPES[dtype])

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the backbone computes in: its patch embedding's
        weight's, read now rather than kept from construction, since
        ``.to()``, ``.half()``, ``.double()`` (or FSDP2's gathered
        ``param_dtype`` parameters) change it afterwards."""
        return self.patch_embed.proj.weight.dtype

    def vit_parameters(self):
        """The pre-trained ViT's parameters (what ``freeze`` freezes and
        the published sizes count); the pyramid is new."""
        yield self.cls_token
        yield self.pos_embed
        yield from self.patch_embed.parameters()
        yield from self.blocks.parameters()

    def init_weights(self) -> None:
        """``init_cfg`` first, then ``pretrained`` (any known layout) over
        it: the checkpoint sets the ViT, ``init_cfg`` whatever it leaves
        new (the pyramid)."""
        if self.pretrained is None:
            nn.init.trunc_normal_(self.pos_embed, std=0.02)
            nn.init.trunc_normal_(self.cls_token, std=0.02)
        if self.init_cfg is not None:
            super().init_weights()
        if self.pretrained is None:
            return
        converted = load_internvit_checkpoint(self.pretrained)
        print_log(
            f'InternViT: {self.pretrained}: {converted.summary()}',
            logger='current')
        self._load_converted(converted, source=self.pretrained)

    def load_public_state_dict(self,
                               checkpoint: dict,
                               allow_partial: Optional[bool] = None) -> tuple:
        """Load a checkpoint (any layout of :mod:`.intern_vit_checkpoint`).

        Position embeddings of another grid and patch kernels of another
        size are resized bicubically. The pyramid (``up1``..``up4``) may be
        absent: it is new unless the checkpoint is a segmentor's.

        Args:
            checkpoint (dict): A loaded checkpoint.
            allow_partial (bool, optional): See the class. Defaults to the
                model's ``allow_partial``.

        Returns:
            tuple: ``(missing_keys, unexpected_keys)``.

        Raises:
            RuntimeError: Parameters of the pre-trained ViT stay unloaded,
                or the checkpoint has tensors the backbone lacks or of
                other shapes, and ``allow_partial`` is False.
        """
        return self._load_converted(
            convert_checkpoint(checkpoint),
            source='checkpoint',
            allow_partial=allow_partial)

    def _load_converted(self,
                        converted,
                        source: str,
                        allow_partial: Optional[bool] = None) -> tuple:
        if allow_partial is None:
            allow_partial = self.allow_partial
        state = dict(converted.backbone)
        if 'pos_embed' in state:
            state['pos_embed'] = resize_pos_embed(state['pos_embed'],
                                                  self.grid)
        if 'patch_embed.proj.weight' in state:
            state['patch_embed.proj.weight'] = resize_patch_kernel(
                state['patch_embed.proj.weight'], self.patch_size)
        own = self.state_dict()
        mismatched = [
            f'{k} {tuple(v.shape)} vs {tuple(own[k].shape)}'
            for k, v in state.items() if k in own and v.shape != own[k].shape
        ]
        state = {
            k: v
            for k, v in state.items()
            if k not in own or v.shape == own[k].shape
        }
        result = self.load_state_dict(state, strict=False)
        vit_ids = {id(p) for p in self.vit_parameters()}
        vit = {n for n, p in self.named_parameters() if id(p) in vit_ids}
        missing = list(result.missing_keys)
        unexpected = list(result.unexpected_keys)
        missing_vit = [k for k in missing if k in vit]
        matched = len(state) - len(unexpected)
        report = (f'{source} ({converted.layout} layout): {matched} tensors '
                  f'loaded, {len(missing_vit)} ViT parameters missing '
                  f'{missing_vit[:5]}, {len(unexpected)} unexpected '
                  f'{unexpected[:5]}, {len(mismatched)} of another shape '
                  f'{mismatched[:3]}')
        if missing_vit or unexpected or mismatched:
            if not allow_partial:
                raise RuntimeError(
                    f'InternViT: {report}; training would start from random '
                    'weights. Check the checkpoint and the architecture, or '
                    'pass allow_partial=True to load it anyway.')
            print_log(
                f'InternViT: partial load (allow_partial=True): '
                f'{report}',
                logger='current',
                level=logging.WARNING)
        else:
            pyramid = len(missing) - len(missing_vit)
            print_log(
                f'InternViT: {report}' +
                (f'; the pyramid ({pyramid} tensors) is new'
                 if pyramid else ''),
                logger='current')
        return missing, unexpected

    def train(self, mode: bool = True):
        super().train(mode)
        if self.freeze:
            # No stochastic depth in a frozen backbone.
            self.blocks.eval()
        return self

    def _forward_blocks(self, x):
        outs = []
        for i, block in enumerate(self.blocks):
            if self.with_cp and self.training and x.requires_grad:
                x = cp.checkpoint(block, x, use_reentrant=False)
            else:
                x = block(x)
            if i in self.out_indices:
                outs.append(x)
            if i >= max(self.out_indices):
                break
        return outs

    def forward(self, x):
        b, _, h, w = x.shape
        # Read now, not at construction: see ``dtype``.
        dtype = self.dtype
        x = self.patch_embed(x.to(dtype))
        gh, gw = x.shape[-2:]
        x = x.flatten(2).transpose(1, 2)
        pos = self.pos_embed
        if (gh, gw) != (self.grid, self.grid):
            if gh != gw:
                raise ValueError(f'InternViT needs square inputs here, but '
                                 f'got {h}x{w}')
            pos = resize_pos_embed(pos, gh)
        x = torch.cat([self.cls_token.expand(b, -1, -1), x], dim=1) + pos
        with torch.set_grad_enabled(torch.is_grad_enabled()
                                    and not self.freeze):
            outs = self._forward_blocks(x)
        # Contiguous copies, not views of the tokens: the heads' convolutions
        # want them so anyway, and a view returned from an FSDP2 unit would
        # lose its pre-backward hook to any in-place op downstream.
        maps = [
            o[:, 1:].transpose(1, 2).reshape(b, -1, gh, gw).contiguous()
            for o in outs
        ]
        if self.with_fpn:
            maps = [
                op(m) for op, m in zip((self.up1, self.up2, self.up3,
                                        self.up4), maps)
            ]
        # The heads are fp32 (float64 after ``.double()``): bf16 / fp16
        # features are widened for them, float64 ones left as they are.
        out_dtype = _compute_dtype(dtype)
        return tuple(m.to(out_dtype) for m in maps)
