"""``docs/en/advanced_guides/own_hooks.md``, run as written.

The page's python blocks that open with a comment naming a file (``#
my_hooks/sign.py``) are a plugin's files: written out here as they stand
(the blocks of one file joined in page order), imported through the
page's own config (its ``custom_imports``), then trained with on two gloo
ranks through real DDP and a real MMEngine Runner, resumed, counted and
projected. The page's other python blocks are short snippets, run here
too, but for the record's, which ``test_plugin_records`` runs.
"""
import importlib
import os.path as osp
import re
import runpy
import sys

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel as DDP

from mmcv_custom.analysis.cost import (Cluster, ParamSpec, ddp_buckets,
                                       hook_costs, recommend)
from mmcv_custom.comm.builder import build_comm_hook, check_comm_hook_cfg
from mmcv_custom.comm.records import unregister_hook_record
from mmcv_custom.comm.registry import COMM_HOOK_STATES, COMM_HOOKS
from mmcv_custom.comm.telemetry import CommCounter
from mmcv_custom.comm.traffic import sent_bytes
from mmcv_custom.launching.preflight.config_values import comm_hook_problems
from mmcv_custom.launching.running import load_config
from mmcv_custom.testing import run_ranks
from tests.runner_utils import build_runner, train_and_gather
from tests.tool_utils import load_script

ROOT = osp.dirname(osp.dirname(osp.dirname(osp.abspath(__file__))))
PAGE = osp.join(ROOT, 'docs', 'en', 'advanced_guides', 'own_hooks.md')
TOOL = 'tools/analysis_tools/comm_cost_model.py'
_PYTHON = re.compile(r'^```python\n(.*?)^```$', re.M | re.S)
_FILE = re.compile(r'# ([\w/.-]+\.py)\n')
# The snippets without a file, in page order: the first two are run here,
# the record's by test_plugin_records.
_SNIPPETS = (
    'from mmcv_custom import COMM_HOOKS, COMM_HOOK_STATES',
    'from mmcv_custom import COMM_HOOK_STATES, require_int, with_args_check',
    'from mmcv_custom.comm import COMM_HOOKS, HookRecord, sends_bucket')
_MODULES = ('my_hooks', 'my_hooks.sign', 'test_my_hooks', 'project_sign')


def _page() -> str:
    with open(PAGE, encoding='utf-8') as f:
        return f.read()


def _flat(text: str) -> str:
    """Words only: the page wraps what it quotes."""
    return ' '.join(text.split())


def _page_files(text: str):
    """``({file: code}, [snippet, ...])``: the blocks naming a file,
    joined per file in page order (the naming line left out), and the
    others."""
    files, snippets = {}, []
    for block in _PYTHON.findall(text):
        named = _FILE.match(block)
        if named is None:
            snippets.append(block)
            continue
        code = block[named.end():]
        name = named.group(1)
        files[name] = files[name] + '\n\n' + code if name in files else code
    return files, snippets


def _forget(names):
    for name in names:
        COMM_HOOKS.module_dict.pop(name, None)
        COMM_HOOK_STATES.module_dict.pop(name, None)


@pytest.fixture(scope='module')
def plugin(tmp_path_factory):
    """The page's files in a folder on ``sys.path``, and its config read
    as the tools read one (its ``custom_imports`` imported: ``sign_ef``
    registered). Everything it registered is forgotten afterwards; the
    ranks forked meanwhile inherit it."""
    folder = tmp_path_factory.mktemp('own_hooks')
    files, _ = _page_files(_page())
    for name, code in files.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(code)
    sys.path.insert(0, str(folder))
    try:
        cfg = load_config(str(folder / 'my_sign_config.py'))
        yield folder, cfg, sys.modules['my_hooks.sign']
    finally:
        hook = COMM_HOOKS.module_dict.get('sign_ef')
        _forget(['sign_ef'])
        if hook is not None:
            unregister_hook_record(hook)
        sys.path.remove(str(folder))
        for name in _MODULES:
            sys.modules.pop(name, None)


def test_every_python_block_of_the_page_is_run():
    files, snippets = _page_files(_page())
    assert sorted(files) == [
        'my_hooks/sign.py', 'my_sign_config.py', 'project_sign.py',
        'test_my_hooks.py'
    ]
    # A new block is a file of the plugin (it opens with its name) or a
    # snippet this test runs.
    assert [s.splitlines()[0] for s in snippets] == list(_SNIPPETS)


def test_the_snippets_do_what_the_page_says():
    _, snippets = _page_files(_page())
    try:
        shape = {}
        exec(snippets[0], shape)
        checked = check_comm_hook_cfg(shape['comm_hook'])
        assert checked['wrapper'] == 'bf16'
        assert checked['state_kwargs'] == dict(my_arg=2)
        # The next snippet registers its own factory under the name.
        COMM_HOOK_STATES.module_dict.pop('my_hook')
        exec(snippets[1], {})
        with pytest.raises(ValueError) as info:
            check_comm_hook_cfg(dict(type='my_hook', every=0))
        assert f'ValueError: {info.value}' in _flat(_page())
    finally:
        _forget(['my_hook'])


def test_the_page_s_config_registers_the_hook_with_its_record(plugin):
    _, cfg, sign = plugin
    assert COMM_HOOKS.get('sign_ef') is sign.sign_ef_hook
    assert check_comm_hook_cfg(
        cfg.comm_hook)['state_kwargs'] == dict(error_feedback=True)
    record = sign.SIGN_RECORD
    assert record.state_keeper is sign.SignStateKeeper
    assert (record.label, record.accuracy) == ('sign + EF', 'quantized_ef')


@pytest.mark.parametrize('change,message', [
    (dict(error_feedback='yes'), "comm_hook sign_ef: error_feedback should "
     "be True or False, but got str: 'yes'"),
    (dict(block_size=64), "comm_hook type 'sign_ef' got unexpected keys "
     "['block_size']. Valid keys: type, wrapper, error_feedback (the "
     "process group is the DDP model's own)."),
    (dict(wrapper='bf16'), "comm_hook type 'sign_ef' already quantizes to "
     "1-bit signs, so wrapper='bf16' would round twice. Drop the wrapper."),
])
def test_a_config_s_mistakes_are_named_as_the_page_quotes(
        plugin, change, message):
    _, cfg, _ = plugin
    cfg = cfg.copy()
    cfg.comm_hook = dict(cfg.comm_hook, **change)
    # The preflight of tools/train.py, before any work.
    assert [str(p) for p in comm_hook_problems(cfg)] == [message]
    assert message in _flat(_page())


def test_the_page_s_own_test_passes(plugin):
    test = importlib.import_module('test_my_hooks')
    test.test_sign_ef_loses_nothing_it_drops()


def _one_step(rank, world_size):
    """One step of ``Linear(16, 4)`` under sign_ef, counted: the bytes
    counted and this rank's saved state."""
    model = torch.nn.Linear(16, 4)
    names = {p: n for n, p in model.named_parameters()}
    ddp = DDP(model)
    counter = CommCounter()
    spec = build_comm_hook(
        dict(type='sign_ef'), counter=counter, param_names=names)
    ddp.register_comm_hook(spec.state, spec.hook)
    ddp(torch.randn(8, 16)).square().sum().backward()
    return counter.pop(), spec.state_keeper.state_dict()


@pytest.fixture(scope='module')
def one_step(plugin):
    """Rank 0's :func:`_one_step`, run once for the tests below."""
    return run_ranks(_one_step)[0]


def test_the_bytes_counted_are_the_bytes_the_cost_model_projects(one_step):
    counted, saved = one_step
    # As the page works it out: 2 scales and 9 bytes of signs a rank,
    # gathered from 2 ranks, count 17 bytes against fp32's 272.
    assert counted == (272, 17)
    # The cost model, on the same parameters laid out as DDP does, projects
    # the same collective, and so the same count.
    buckets = ddp_buckets([ParamSpec((4, 16)), ParamSpec((4, ))])
    projected = [(c.kind, c.nbytes)
                 for c in hook_costs()['sign_ef'].collectives(buckets, 2)[0]]
    assert projected == [('all_gather', 17)]
    assert sent_bytes(projected, 2) == counted[1]
    assert sorted(saved['residuals']) == ['bias', 'weight']


def _keeper(sign, error_feedback=True, model=None):
    model = model or torch.nn.Linear(16, 4)
    state = sign.SignState(error_feedback=error_feedback)
    names = {p: n for n, p in model.named_parameters()}
    return sign.SignStateKeeper(state, names), model


def test_the_keeper_restores_its_own_state_and_refuses_another(
        plugin, one_step):
    _, _, sign = plugin
    _, saved = one_step
    keeper, model = _keeper(sign)
    keeper.load_state_dict(saved)
    assert torch.equal(keeper.state.residuals[model.weight],
                       saved['residuals']['weight'])
    # What it saves is what it restored, by name.
    again = keeper.state_dict()['residuals']
    assert all(torch.equal(again[n], r) for n, r in saved['residuals'].items())
    keeper.start_fresh(4)
    assert keeper.state.residuals == {}
    assert keeper.fresh_note(4) == 'error feedback from zero'

    wider, _ = _keeper(sign, model=torch.nn.Linear(16, 5))
    cases = [
        (wider, saved, 'its residual of weight does not fit the parameter '
         '(80 values)'),
        (_keeper(sign, model=torch.nn.Linear(16, 4, bias=False))[0], saved,
         'it has a residual of bias, a parameter this model does not have'),
        (_keeper(sign, error_feedback=False)[0], saved, 'it holds residuals, '
         'but error_feedback is False here: nothing would use them'),
        (keeper, dict(saved, version=2),
         'it is not a SignStateKeeper.state_dict() of version 1'),
        (keeper, [], 'it is not a SignStateKeeper.state_dict() of version 1'),
    ]
    for refusing, given, message in cases:
        with pytest.raises(ValueError) as info:
            refusing.load_state_dict(given)
        assert str(info.value) == message
    assert wider.state.residuals == {}  # a refusal changes nothing


def test_the_cost_model_prints_what_the_page_shows(plugin, capsys):
    folder, _, _ = plugin
    runpy.run_path(str(folder / 'project_sign.py'), run_name='__main__')
    printed = capsys.readouterr().out
    text = _page()
    shown = text[text.index('# project_sign.py'):]
    shown = shown.split('```text\n', 1)[1].split('```', 1)[0]
    assert printed == shown


def test_a_recommendation_weighs_it_by_its_class(plugin):
    """The record's ``accuracy`` at work: ``sign_ef`` (quantized with error
    feedback), the fastest on the page's four nodes, is weighed only where
    ``max_loss`` allows its class, and its line says it has no evidence."""
    params = [ParamSpec((4096, 4096))] * 24
    cluster = Cluster(nodes=4, gpus_per_node=1, link_bps=25e9)

    def pick(max_loss):
        return recommend(
            params,
            cluster,
            backward_s=0.2,
            compute_step_s=0.3,
            max_loss=max_loss)

    assert pick('quantized_ef').best == 'sign_ef'
    said = 'Evidence: none recorded for this hook.'
    assert said in pick('quantized_ef').line()
    assert said in _flat(_page())
    assert pick('half').best == 'bf16_compress'


def _train(rank, world_size, work_dir, comm_hook, max_iters, resume):
    runner, records = build_runner(
        work_dir,
        comm_hook,
        max_iters=max_iters,
        # 2 kB buckets: the parameters move between buckets when DDP lays
        # them out again, and a resumed run starts in another layout.
        wrapper=dict(
            type='MMDistributedDataParallel',
            device_ids=None,
            bucket_cap_mb=0.002),
        checkpoint=dict(type='CheckpointHook', interval=4, by_epoch=False),
        resume=resume)
    return train_and_gather(runner, records, world_size)


@pytest.mark.slow
def test_a_resumed_run_restores_every_rank_s_residuals_bit_for_bit(
        plugin, tmp_path):
    """The page's config trained 10 steps, and 4 steps then resumed to
    10: the keeper's residuals, saved beside ``iter_4.pth`` by each rank
    and restored into the resumed run's buckets, make the two the same
    weights bit for bit."""
    _, cfg, _ = plugin
    whole, _ = run_ranks(_train, str(tmp_path / 'whole'), cfg.comm_hook, 10,
                         False)[0]
    part = tmp_path / 'part'
    run_ranks(_train, str(part), cfg.comm_hook, 4, False)
    saved = [
        torch.load(part / f'iter_4.pth.comm_hook_rank{r}.pth')['hooks']['']
        for r in range(2)
    ]
    # Something to restore: each rank held back its own.
    assert all(s['residuals']['net.0.weight'].abs().max() > 0 for s in saved)
    resumed, lines = run_ranks(_train, str(part), cfg.comm_hook, 10, True)[0]
    restored = (f'Restored the sign_ef state (error feedback) of all 2 ranks '
                f'from the files beside {part}/iter_4.pth.')
    assert ('INFO', restored) in lines
    # The page quotes the line of a work dir of its own.
    assert _flat(restored.replace(str(part),
                                  'work_dirs/my_sign')) in _flat(_page())
    assert torch.equal(resumed[0], whole[0])
    assert torch.equal(resumed[0], resumed[1])


@pytest.mark.slow
def test_the_cost_model_s_command_line_recommends_as_the_page_says(
        plugin, capsys):
    # The page's command, run in this process (the plugin is imported
    # already; tests/test_analysis/test_plugin_tools.py runs --import in a
    # fresh interpreter).
    text = _page()
    command = text[text.index('PYTHONPATH=$MY_PROJECT'):].split('```')[0]
    words = command.replace('\\\n', ' ').split()
    args = words[words.index(TOOL) + 1:]
    tool = load_script(osp.join(ROOT, TOOL), 'comm_cost_model')
    tool.main(args)
    lines = capsys.readouterr().out.splitlines()
    sign = [line for line in lines if line.startswith('| sign_ef | ')]
    assert len(sign) == 2 and '(does not fit)' in sign[0]
    # The shortest step, not recommended.
    steps = {
        line.split(' | ')[0][2:]: float(line.split(' | ')[2])
        for line in lines if line.startswith('| ') and ' | 25 | ' in line
    }
    assert min(steps, key=steps.get) == 'sign_ef'
    assert any(
        line.startswith('- 25 Gbit/s: use bf16_compress: ') for line in lines)
