"""How the ``comm_hook`` config is carried out on an FSDP2 model: the part
of :class:`~.comm_hook_registration_hook.CommHookRegistrationHook` for
models ``FSDP2Strategy`` sharded (that hook reads and checks the config once,
and keeps telemetry, state files and ``auto``'s trials for both kinds).

Under full sharding the config sets every unit's reduce-scatter
(:mod:`mmcv_custom.hooks.sharded`); under hybrid sharding FSDP2
reduce-scatters inside the node as it does, and the config sets the format
of each unit's cross-node all-reduce (:mod:`mmcv_custom.hooks.hybrid`),
``int8_compress``'s per-unit error feedback saved beside the checkpoints.
"""
from typing import Optional

import torch
from mmengine.dist import is_main_process

from ..comm.auto import AUTO
from ..comm.builder import CommHookConfig
from ..comm.sharded import build_sharded_comm, sharded_topology
from ..comm.telemetry import CommCounter
from ..hooks.cast import cpu_codec
from ..hooks.half import CompressState
from ..hooks.hybrid import (CrossNodeAllReduce, HybridInt8State,
                            HybridInt8StateKeeper, Int8CrossNodeAllReduce,
                            cross_node_group, install_cross_node)
from ..hooks.int8 import Int8State
from ..hooks.int8_codec import codec_in_use
from ..hooks.sharded import (fsdp_replicas, make_reduce_scatter,
                             set_reduce_scatter)
from .auto_comm import AutoComm
from .hook_state_files import HookStateFiles
from .process_group import launcher_claim

__all__ = ['FSDP2CommMixin', 'describe_cfg', 'codec_note']


def describe_cfg(cfg) -> str:
    """A config (a mapping) as written, ``dict(type=..., ...)``."""
    return 'dict(' + ', '.join(f'{k}={v!r}' for k, v in cfg.items()) + ')'


def codec_note(spec, param) -> str:
    """The registration line's last part: what runs ``spec``'s int8 codec
    (any device; DDP's hook or FSDP2's reduce-scatter), or its casts to
    half precision on CPU; '' for neither. Called on every rank (it
    raises on a bad ``MMCV_CUSTOM_INT8_FUSED``)."""
    if param is None:
        return ''
    block = getattr(spec, 'int8_block_size', None)
    if isinstance(spec.state, Int8State):
        block = spec.state.block_size
    if block is not None:
        return f'; int8 codec: {codec_in_use(param.device, block)}'
    if param.device.type == 'cpu' and (getattr(spec, 'wrapper', None) or
                                       isinstance(spec.state, CompressState)):
        return f'; CPU casts: {cpu_codec()}'
    return ''


class FSDP2CommMixin:
    """The FSDP2 methods of the runner hook (see the module docstring);
    they use its ``_config`` (checked for FSDP2), ``_telemetry``,
    ``_auto``, ``_loaded_auto``, ``_loaded_record``, ``_state_files``,
    ``_counters`` and ``_installed``."""

    def _install_sharded(self, runner) -> None:
        """FSDP2: the same config sets every sharded module's
        reduce-scatter (see :mod:`mmcv_custom.hooks.sharded`); ``auto``
        installs each candidate's in turn, then the chosen one's."""
        model = runner.model
        names = {p: n for n, p in model.named_parameters()}
        counter = CommCounter() if self._telemetry else None
        ids = {id(p): n for p, n in names.items()}
        replicas = fsdp_replicas(model)
        if replicas > 1:
            self._install_hybrid(runner, names, counter, ids)
            return

        def build(config):
            spec, comm = self._sharded_comm(config, names, counter, replicas)
            return spec, comm, spec.topology_used.startswith('two-level')

        config = self._config_or_trials(
            runner, build, lambda comm: set_reduce_scatter(model, comm),
            counter, ids)
        if config is None:
            return
        spec, comm = self._sharded_comm(config, names, counter, replicas)
        self._register_sharded(runner, spec, set_reduce_scatter(model, comm),
                               counter, ids)

    def _config_or_trials(self, runner, build, install, counter,
                          ids: dict) -> Optional[CommHookConfig]:
        """The config to install: ``comm_hook`` itself, or under ``auto``
        the choice a resumed run kept; None where ``auto``'s trials start
        instead (each candidate built by ``build``, checked config ->
        ``(spec, comm, two_level)``, and put on the model by
        ``install``)."""
        config = self._config
        if config.type != AUTO:
            return config
        self._auto = AutoComm(config, self._loaded_auto)
        if self._auto.kept(runner) is not None:
            return self._auto.chosen()
        self._counters = [counter]
        self._auto.start_sharded(runner, build, install)
        self._installed = [('', self._auto.active()[0], counter, ids)]
        return None

    def _install_hybrid(self, runner, names: dict, counter, ids: dict) -> None:
        """Hybrid sharding: FSDP2 reduce-scatters inside the node as it
        does, and the config sets the format of each unit's cross-node
        all-reduce (:mod:`mmcv_custom.hooks.hybrid`); ``int8_compress``'s
        error feedback is kept per unit and saved beside the checkpoints.
        ``auto`` tries the candidates that run under full sharding too."""
        model = runner.model
        group = cross_node_group(model)

        def build(config):
            spec, comm, _ = self._hybrid_comm(config, names, counter, group)
            return spec, comm, False

        config = self._config_or_trials(
            runner, build, lambda comm: install_cross_node(model, comm),
            counter, ids)
        if config is None:
            return
        spec, comm, state = self._hybrid_comm(config, names, counter, group)
        if self._config.topology != 'auto':
            spec.notes += (
                f'comm_hook topology={self._config.topology!r} changes '
                'nothing under hybrid sharding: the all-reduce that crosses '
                'the nodes already runs among one rank a node, and the '
                'reduce-scatter stays inside the node. Remove topology.', )
        if state is not None and state.error_feedback:
            world = torch.distributed.get_world_size()
            layout = (group.size(), world // group.size())
            self._state_files = HookStateFiles(
                {'': HybridInt8StateKeeper(state, layout)}, config)
        self._register_sharded(runner, spec, install_cross_node(model, comm),
                               counter, ids)
        if self._state_files is not None:
            self._state_files.start()
            if runner.iter > 0:
                self._state_files.restore(runner, self._loaded_record,
                                          self._resumed_checkpoint(runner))

    @staticmethod
    def _hybrid_comm(config: CommHookConfig, names: dict, counter,
                     group) -> tuple:
        """``(spec, cross-node all-reduce, int8 state or None)`` of
        ``config`` under hybrid sharding, ``group`` the nodes."""
        spec = build_sharded_comm(config, param_names=names, hybrid=True)
        sharded_topology(spec, None, group.size())
        if spec.int8_block_size is None:
            return spec, CrossNodeAllReduce(group, spec.sent_dtype,
                                            counter), None
        state = HybridInt8State(spec.int8_block_size, spec.error_feedback,
                                spec.residual_dtype)
        return spec, Int8CrossNodeAllReduce(group, state, counter), state

    @staticmethod
    def _sharded_comm(config: CommHookConfig,
                      names: dict,
                      counter,
                      replicas: int = 1) -> tuple:
        """``(spec, reduce-scatter)`` of ``config`` under FSDP2, sharded
        over each node with ``replicas`` > 1 (hybrid). Collective: the
        topology is decided on every rank together."""
        spec = build_sharded_comm(config, param_names=names)
        topology = sharded_topology(spec, launcher_claim(), replicas)
        return spec, make_reduce_scatter(spec.sent_dtype, counter,
                                         spec.int8_block_size, topology.groups)

    def _register_sharded(self, runner, spec, units: int, counter,
                          ids: dict) -> None:
        """Note what FSDP2 reduces with, and say it on rank 0."""
        self._installed = [('', spec, counter, ids)]
        codec = codec_note(spec, next(runner.model.parameters(), None))
        if is_main_process():
            group = torch.distributed.group.WORLD
            chosen = (f', chosen by comm_hook auto, '
                      f'{describe_cfg(self._auto.decision.config)}'
                      if self._auto else '')
            cross = cross_node_group(runner.model)
            nodes = ('' if cross is None else f' as {cross.size()} nodes x '
                     f'{group.size() // cross.size()}')
            runner.logger.info(
                'Registered the gradient reduction on the FSDP2 model '
                f'({units} sharded modules{chosen}): {spec.describe()}; '
                f'process group: {group.size()} ranks{nodes}, backend '
                f'{torch.distributed.get_backend(group)}{codec}.')
            for note in spec.notes:
                runner.logger.warning(note)
