"""The README and the pages under docs/en/: every relative link resolves,
every repository path they show exists, the README stays a two-minute
read, its hook table names every built-in hook, each figure the pages
repeat reads as its one source page has it, and what they quote of the
code (the ``auto`` log, the cost model's assumptions) is what the code
does. Reads files, and the code's tables; starts nothing."""
import glob
import os.path as osp
import re
from typing import Callable

import pytest


def _root() -> str:
    # The repository root, wherever this file sits under tests/.
    here = osp.dirname(osp.abspath(__file__))
    while not osp.isfile(osp.join(here, 'setup.py')):
        parent = osp.dirname(here)
        assert parent != here, 'no setup.py above tests/'
        here = parent
    return here


ROOT = _root()
README = osp.join(ROOT, 'README.md')
PAGES = [README] + sorted(
    glob.glob(osp.join(ROOT, 'docs', 'en', '**', '*.md'), recursive=True))
README_MAX_LINES = 220

_FENCE = re.compile(r'^```.*?^```[ \t]*$', re.M | re.S)
_SPAN = re.compile(r'`[^`]+`')
_LINK = re.compile(r'!?\[[^\]]*\]\(([^)\s]+)\)')
# configs/..., tools/... and mmcv_custom/... files, not inside a longer
# token (a placeholder such as CONFIG never matches).
_PATH = re.compile(r'(?<![\w./-])((?:configs|tools|mmcv_custom)/[\w./-]*'
                   r'\.(?:py|sh|c))(?![\w/-])')


def _read(path: str) -> str:
    with open(path, encoding='utf-8') as f:
        return f.read()


def _rel(path: str) -> str:
    return osp.relpath(path, ROOT)


def _prose(text: str) -> str:
    """``text`` without code blocks and code spans (links inside code are
    not links)."""
    return _SPAN.sub('', _FENCE.sub('', text))


def _code(text: str) -> str:
    """The code blocks and code spans of ``text``, one after another."""
    blocks = _FENCE.findall(text)
    spans = _SPAN.findall(_FENCE.sub('', text))
    return '\n'.join(blocks + spans)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped
    (``_`` and ``-`` kept), spaces to hyphens."""
    return re.sub(r'[^\w\- ]', '', heading.strip().lower()).replace(' ', '-')


def _anchors(path: str) -> set:
    seen, out = {}, set()
    for line in _FENCE.sub('', _read(path)).splitlines():
        match = re.match(r'#{1,6} (.+)', line)
        if not match:
            continue
        slug = _slug(match.group(1))
        count = seen.get(slug, 0)
        seen[slug] = count + 1
        out.add(slug if count == 0 else f'{slug}-{count}')
    return out


def _section(text: str, title: str) -> str:
    lines = text.splitlines()
    start = lines.index(f'## {title}')
    end = next(
        (i
         for i in range(start + 1, len(lines)) if lines[i].startswith('## ')),
        len(lines))
    return '\n'.join(lines[start + 1:end])


def test_there_are_pages():
    names = {_rel(p) for p in PAGES}
    for page in ('docs/en/index.md', 'docs/en/get_started.md',
                 'docs/en/notes/benchmarks.md', 'docs/en/design/layout.md'):
        assert page in names, sorted(names)


@pytest.mark.parametrize('page', PAGES, ids=_rel)
def test_relative_links_resolve(page):
    broken = []
    for target in _LINK.findall(_prose(_read(page))):
        if re.match(r'[a-z][a-z0-9+.-]*:', target):  # http:, mailto: ...
            continue
        path, _, anchor = target.partition('#')
        path = (
            osp.normpath(osp.join(osp.dirname(page), path)) if path else page)
        if not osp.exists(path):
            broken.append(f'{target}: no such file')
        elif anchor and path.endswith('.md') and \
                anchor not in _anchors(path):
            broken.append(f'{target}: no heading #{anchor} in {_rel(path)}')
    assert not broken, f'{_rel(page)}: ' + '; '.join(broken)


@pytest.mark.parametrize('page', PAGES, ids=_rel)
def test_paths_in_commands_exist(page):
    paths = set(_PATH.findall(_code(_read(page))))
    missing = sorted(p for p in paths if not osp.exists(osp.join(ROOT, p)))
    assert not missing, f'{_rel(page)} shows paths that do not exist: ' \
        f'{missing}'


def test_readme_is_short_with_a_two_command_quick_start():
    text = _read(README)
    assert len(text.splitlines()) <= README_MAX_LINES
    blocks = _FENCE.findall(_section(text, 'Quick start'))
    assert len(blocks) == 1, blocks
    commands = [
        line.split('#')[0].strip() for line in blocks[0].splitlines()[1:-1]
    ]
    assert [c for c in commands if c] == ['make demo', 'make test']


def test_readme_hook_table_names_every_registered_hook():
    from mmcv_custom.comm.builtins import BUILTIN_HOOKS

    # Built-in hooks only: tests register hooks of their own in the same
    # registry when they run in the same session.
    registered = {builtin.name for builtin in BUILTIN_HOOKS}
    assert registered
    rows = [
        line for line in _section(_read(README), 'Hooks').splitlines()
        if line.startswith('| `')
    ]
    in_table = {re.match(r'\| `([^`]+)`', row).group(1) for row in rows}
    assert registered <= in_table, sorted(registered - in_table)


# Options whose value is a file a command writes.
_OUTPUTS = ('--json', '--plot', '--work-dir')


@pytest.mark.parametrize('page', PAGES, ids=_rel)
def test_commands_use_the_venv_and_write_under_work_dirs(page):
    """A command copied from the docs runs the repository's interpreter
    (the launch scripts pick ``.venv/bin/python`` themselves) and leaves
    its outputs under ``work_dirs/`` (ignored by git), not in the
    checkout."""
    bad = []
    for block in _FENCE.findall(_read(page)):
        if not re.match(r'```(bash|sh|shell)\b', block):
            continue
        words = ' '.join(
            line.split('#')[0].rstrip(' \\')
            for line in block.splitlines()[1:-1]).split()
        for i, word in enumerate(words):
            if word in ('python', 'python3'):
                bad.append(f'{word} (use .venv/bin/python)')
            value = words[i + 1] if i + 1 < len(words) else ''
            # A placeholder (DIR, OUT) is the reader's to choose.
            if word in _OUTPUTS and not re.fullmatch(r'[A-Z_]+\]?', value) \
                    and not value.startswith('work_dirs/'):
                bad.append(f'{word} {value} (not under work_dirs/)')
    assert not bad, f'{_rel(page)}: ' + '; '.join(bad)


def test_work_dirs_is_ignored():
    ignored = _read(osp.join(ROOT, '.gitignore')).split()
    assert 'work_dirs/' in ignored


def test_the_6b_size_is_the_model_s_wherever_it_is_quoted():
    """One source for the figure every page repeats: the parameters and
    gradient bytes of InternViT-6B's UperNet, as the cost model builds it
    (on the meta device) from the recipe."""
    from mmcv_custom.analysis.cost.model import config_params
    params, _, _ = config_params(
        osp.join(ROOT, 'configs', 'intern_vit',
                 'upernet_intern-vit-6b_8xb2-80k_ade20k-504x504.py'))
    count = f'{sum(p.numel for p in params) / 1e9:.2f}e9'
    size = f'{sum(p.nbytes for p in params) / 1e9:.2f} GB'
    quoted = {
        README:
        'trainable parameters, {size} of gradients',
        osp.join(ROOT, 'docs', 'en', 'notes', 'comm_cost_model.md'):
        'trainable parameters (the ViT',
    }
    for page, tail in quoted.items():
        text = ' '.join(_read(page).split())
        assert f'{count} {tail.format(size=size)}' in text, (_rel(page), count,
                                                             size)
    assert f'{size} of gradients per step in 158 buckets' in ' '.join(
        _read(osp.join(ROOT, 'docs', 'en', 'notes',
                       'comm_cost_model.md')).split())


def _flat(page: str) -> str:
    """``page`` (a path under the root) with its whitespace runs as one
    space, so that a quote may break lines anywhere."""
    return ' '.join(_read(osp.join(ROOT, page)).split())


def _row(text: str, first_cell: str) -> list:
    """The cells after ``first_cell`` in the first Markdown table row of
    ``text`` that starts with it."""
    for line in text.splitlines():
        if line.startswith(f'| {first_cell} |'):
            return [c.strip() for c in line.strip().strip('|').split('|')][1:]
    raise AssertionError(f'no table row {first_cell!r}')


def _cells(text: str, first_cell: str, header: str = 'hook') -> dict:
    """The cells of that row by the names of the columns: the first
    header row of ``text`` that starts with ``header``."""
    return dict(zip(_row(text, header), _row(text, first_cell)))


def _suite_time(text: str) -> dict:
    text = ' '.join(text.split())
    minutes, seconds = map(
        int,
        re.search(
            r'`\.ci/run` from a fresh clone on this shared 2-core '
            r'host, idle, [^:]*: (\d+) min (\d+) s', text).groups())
    return dict(suite=round(minutes + seconds / 60))


def _link_bytes(text: str) -> dict:
    """What the two-level int8 form puts on a node's link against the flat
    form and ``allreduce``: the payload TCP carried out of node 1 (node 0's
    also holds the BN buffers DDP broadcasts, which no hook sends)."""
    text = _section(text, "Bytes on each node's link, 2 nodes x 2 ranks")
    node1 = {
        hook:
        float(_cells(text, f'`{hook}`')['payload (MB/step)'].split('/')[1])
        for hook in ('allreduce', 'int8_compress:flat',
                     'int8_compress:two_level')
    }
    two_level = node1['int8_compress:two_level']
    return dict(
        flat=two_level / node1['int8_compress:flat'],
        allreduce=two_level / node1['allreduce'])


def _slow_link_steps(text: str) -> dict:
    """The step against ``allreduce``'s on a slow link (the first table of
    the benchmarks: hook -> the ratio at each rate)."""
    text = _section(text, 'Step time on a slow link')
    out = {}
    for hook in ('fp16_compress', 'bf16_compress', 'int8_compress', 'powerSGD',
                 'batched_powerSGD'):
        cells = _cells(text,
                       f'`{hook}`' + (' (rank 4)' if 'SGD' in hook else ''))
        for rate in ('50', '200', '1000'):
            out[f'{hook}_{rate}'] = re.search(r'\((\d\.\d\d)\)',
                                              cells[f'{rate} Mbit/s']).group(1)
    return out


def _two_by_two(text: str) -> dict:
    """The 2 x 2 run's rows (step at 50 Mbit/s and unshaped, payload,
    prediction) that the tools' guide shows a few of."""
    text = _section(text, "Bytes on each node's link, 2 nodes x 2 ranks")
    out = {}
    for hook in ('allreduce', 'int8_compress:flat', 'int8_compress:two_level'):
        cells = _cells(text, f'`{hook}`')
        step, ratio = re.fullmatch(r'(\S+) s \((\S+)\)',
                                   cells['step at 50 Mbit/s']).groups()
        key = hook.replace(':', '_')
        out.update({
            f'{key}_50':
            step,
            f'{key}_x50':
            ratio,
            f'{key}_unshaped':
            cells['step unshaped'].split()[0],
            f'{key}_payload':
            cells['payload (MB/step)'].replace(' ', ''),
            f'{key}_predicted':
            cells['predicted (MB)']
        })
    return out


#: The cost model page's 6B section, and its rows by the names the
#: quotes give them.
_SECTION_6B = 'InternViT-6B UperNet, 8 nodes x 8 GPUs, default constants'
_ROWS_6B = {
    'allreduce': 'allreduce',
    'bf16': 'bf16_compress',
    'int8': 'int8_compress (block 256)',
    'int8_2l': 'int8_compress (block 256) (two-level)',
    'psgd': 'powerSGD (rank 1)',
    'psgd_2l': 'powerSGD (rank 1) (two-level)',
    'bpsgd': 'batched_powerSGD (rank 1)',
    'bpsgd_2l': 'batched_powerSGD (rank 1) (two-level)',
}


def _projection_6b(text: str) -> dict:
    """The 6B projection on 8 x 8 GPUs (the first table of its section):
    at 100 Gbit/s each row's ratio to ``allreduce``, and the flat rows'
    cells at 100, 200 and 400 Gbit/s that the benchmarks' table
    repeats."""
    text = _section(text, _SECTION_6B)
    out = {}
    for name, row in _ROWS_6B.items():
        cells = _cells(text, row)
        out[name] = float(
            re.search(r'\((\d+\.\d+)x\)', cells['100 Gbit/s']).group(1))
        out[f'{name}_cells'] = ' | '.join(
            cells[f'{rate} Gbit/s'].replace(' (1.00x)', '')
            for rate in (100, 200, 400))
    return out


def _fsdp2_memory(text: str) -> dict:
    header = 'InternViT-6B full tuning, per GPU'
    ddp = _cells(text, 'DDP (bf16 backbone, fp32 heads)', header)
    fsdp2 = _cells(text, 'FSDP2, bf16 backbone and fp32 heads (the recipe)',
                   header)
    return dict(
        ddp=float(ddp['8 GPUs'].split()[0]),
        on_8=float(fsdp2['8 GPUs'].split()[0]),
        on_64=float(fsdp2['64']))


def _convergence(text: str) -> dict:
    """The recipes' own hook (``bf16_compress``) in the convergence
    table: the tiny InternViT's mIoU after its 200 iterations."""
    text = _section(text, 'Does each hook train like fp32?')
    cells = _cells(text, '`bf16_compress`', 'variant')
    return dict(
        tiny_vit=float(cells['tiny InternViT, 200 iterations'].split()[0]))


def _run_time(text: str) -> dict:
    """A convergence run's time: the runs of ``--variants all``, timed
    together."""
    runs, minutes = map(
        int,
        re.search(r'\((\d+) runs, about (\d+) minutes on this machine',
                  ' '.join(text.split())).groups())
    return dict(minutes=round(minutes / runs))


def _quoted(pattern: str, *names: str) -> Callable[[str], dict]:
    """Figures read from the source page by ``pattern``'s groups."""

    def read(text: str) -> dict:
        match = re.search(pattern, ' '.join(text.split()))
        assert match, pattern
        return dict(zip(names, match.groups()))

    return read


_TESTS = 'docs/en/notes/tests.md'
_START = 'docs/en/get_started.md'
_BENCH = 'docs/en/notes/benchmarks.md'
_COST = 'docs/en/notes/comm_cost_model.md'
_TOOLS = 'docs/en/user_guides/useful_tools.md'
_HOOKS = 'docs/en/user_guides/comm_hooks.md'
_VIT = 'docs/en/user_guides/intern_vit.md'
_FSDP2 = 'docs/en/user_guides/fsdp2.md'

#: Each figure the pages repeat (issues 31 and 42): (what, its one source
#: page, how to read the figures there, and page -> the sentences that
#: quote them, ``{name}`` for a figure; ``…`` stands for one table cell
#: the source does not hold). A quote that drifts from its source fails.
_REPEATED = (
    ('the suite\'s time, as measured', _TESTS, _suite_time, {
        'README.md': ['suite takes about {suite} minutes on 2 cores'],
        _START: ['(about {suite} minutes on 2 idle cores'],
    }),
    ('the demo\'s idle wall time', _START,
     _quoted(r'(\d+) s when idle\)', 'demo'), {
         'README.md': ['in about {demo} s on an idle 2-core machine'],
     }),
    ('the environment\'s build', _START,
     _quoted(r'about (\d+) minutes on 2 cores the first time', 'build'), {
         'README.md': ['(about {build} minutes on 2 cores: mmcv is'],
     }),
    ('the steps on a slow link', _BENCH, _slow_link_steps, {
        'README.md': [
            'half the bytes: {fp16_compress_50}x the step at 50 Mbit/s',
            'half the bytes: {bf16_compress_50}x at 50 Mbit/s, '
            '{bf16_compress_200}x at 200, {bf16_compress_1000}x at 1000',
            'a quarter of the bytes: {int8_compress_50}x at 50 Mbit/s',
            '| {powerSGD_50}x at 50 Mbit/s; projected',
            '| {batched_powerSGD_50}x at 50 Mbit/s;',
        ],
    }),
    ('where compression pays, and the int8 hook before its thread', _BENCH,
     _quoted(
         r'exposed (\d+-\d+)% of its wire time.* well above the backward '
         r'pass \(here below about (\d+) Mbit/s\)', 'exposed', 'rate'),
     {
         _HOOKS:
         ['below about {rate} Mbit/s)', 'exposed {exposed}% of its wire time'],
     }),
    ('the two-level int8 form\'s bytes on a node\'s link', _BENCH, _link_bytes,
     {
         'README.md': [
             'two-level on 2 x 2 ranks, {flat:.2f}x the flat form\'s bytes '
             'on each node\'s link ({allreduce:.2f}x `allreduce`\'s)'
         ],
         _BENCH: [
             'The two-level form puts {flat:.2f}x the flat form\'s bytes on '
             'the link and {allreduce:.2f}x `allreduce`\'s'
         ],
         _TOOLS: [
             'The two-level form puts {flat:.2f}x the flat form\'s bytes '
             'there ({allreduce:.2f}x `allreduce`\'s)'
         ],
     }),
    ('the 2 x 2 run\'s rows', _BENCH, _two_by_two, {
        _TOOLS: [
            f'| {rate} | `{hook}` | {{{key}_{col}}} | {ratio} | … | '
            f'{{{key}_payload}} | {{{key}_predicted}} |'
            for hook in ('allreduce', 'int8_compress:flat',
                         'int8_compress:two_level')
            for key in [hook.replace(':', '_')]
            for rate, col, ratio in (('50 Mbit/s', '50', f'{{{key}_x50}}'),
                                     ('unshaped', 'unshaped', '…'))
        ],
    }),
    ('what TCP carried against the model', _BENCH,
     _quoted(
         r'What TCP carried is within (\d\.\d+)% of the cost model\'s '
         r'bytes on node 1', 'pct'), {
             _BENCH: ['what TCP carried within {pct}% of the model\'s'],
             _COST: [
                 'is within {pct}% of the model\'s bytes for '
                 '`allreduce`', '2 emulated nodes x 2 ranks (within '
                 '{pct}%'
             ],
             _TOOLS: [
                 'What TCP carried (payload) is within {pct}% of the '
                 'cost model\'s prediction on node 1'
             ],
         }),
    ('gloo\'s framing of PowerSGD\'s all-reduces', _BENCH,
     _quoted(
         r'Both PowerSGD forms carry (\d+)% more than the model counts '
         r'\((\d+) kB a step\)', 'pct', 'kb'), {
             _COST: [
                 'Both forms of `powerSGD` carry {pct}% more (about '
                 '{kb} kB a step)'
             ],
         }),
    ('the model fitted on the 2 x 2 run', _BENCH,
     _quoted(
         r'within (\d+\.\d)% for the three two-level forms .*? within '
         r'(\d+\.\d)% for all seven .*? fits less well \(RMS (\d+\.\d)%, '
         r'worst (\d+)%\)', 'two_level', 'all', 'rms', 'worst'), {
             _COST: [
                 'predicts the 200 Mbit/s steps within {two_level}% for the '
                 'two-level forms and {all}% for all',
                 'fitted less well (RMS {rms}%, worst {worst}%)'
             ],
         }),
    ('the model fitted on the InternViT runs', _BENCH,
     _quoted(
         r'at 100 and 300 Mbit/s \(two runs\) within (\d+\.\d)%.*? grows '
         r'from (\d+)% of the compute step on two nodes to (\d+)% on three',
         'fcn', 'two', 'three'), {
             _COST: [
                 'predicts the FCN toy within {fcn}%; at 3 ranks on 2 cores '
                 'PowerSGD\'s share grows from {two}% to {three}%'
             ],
         }),
    ('the 6B projection on 8 x 8 GPUs', _COST, _projection_6b, {
        'README.md': [
            'projected {int8_2l:.1f}x faster than `allreduce` on 8 x 8 GPUs '
            'at 100 Gbit/s (the flat form: {int8:.2f}x)',
            'on 8 x 8 GPUs at 100 Gbit/s, {psgd:.1f}x faster than '
            '`allreduce` (two-level: {psgd_2l:.1f}x)',
            '{bpsgd:.1f}x projected for InternViT-6B (two-level: '
            '{bpsgd_2l:.1f}x)'
        ],
        _BENCH: [
            'two-level `int8_compress` {int8_2l:.2f}x `allreduce` at 100 '
            'Gbit/s on 8 x 8 GPUs',
            '| `allreduce` | {allreduce_cells} |',
            '| `bf16_compress` | {bf16_cells} |',
            '| `int8_compress` | {int8_cells} |',
        ],
        _COST: [
            '**{int8_2l:.2f}x** (flat: {int8:.2f}x)',
            'is faster still ({bpsgd_2l:.2f}x at 100 Gbit/s)'
        ],
    }),
    ('the 6B recipe\'s memory per GPU', _BENCH, _fsdp2_memory, {
        'README.md': [
            'drops from {ddp:.0f} GiB per GPU under DDP to {on_8:.1f} GiB on '
            '8 GPUs'
        ],
        _FSDP2: [
            'Per GPU it needs {on_8:.2f} GiB on 8 GPUs, {on_64:.2f} GiB on '
            '64, against DDP\'s {ddp:.2f}'
        ],
        _VIT: [
            'and {ddp:.2f} GiB per GPU under DDP',
            'the 6B full tuning needs {on_8:.2f} GiB per GPU on 8 GPUs'
        ],
    }),
    ('the 6B recipe\'s int8 state per GPU under DDP (issue 43)', _COST,
     _quoted(
         r'`int8_compress` adds 6\.39e9 x 4 B = (\d+\.\d+) GiB, '
         r'(\d+\.\d+) GiB in all', 'state', 'total'), {
             _TOOLS: [
                 '(int8 on the 6B recipe: {state} GiB per GPU, {total} GiB '
                 'in all'
             ],
             'docs/en/notes/changelog.md':
             ['(the 6B\'s int8 needs {total} GiB per GPU under DDP)'],
         }),
    ('the 6B FSDP2 recipe on 4 x 8 GPUs at 25 Gbit/s, hybrid (issue 43)',
     _COST,
     _quoted(
         r"\| 4 x 8, 25 Gbit/s \| hybrid \| `int8_compress`, "
         r"`residual_dtype='bfloat16'` \| (\d+\.\d+) s \| (\d+\.\d+) GiB "
         r'\| (\d+\.\d+) s \| (\d+\.\d+) s \|', 'step', 'memory', 'full',
         'hybrid'), {
             _FSDP2: [
                 "| 4 x 8, 25 Gbit/s | hybrid | `int8_compress`, "
                 "`residual_dtype='bfloat16'` | {step} s | {memory} GiB | "
                 '{full} s | {hybrid} s |',
                 'Its {memory} GiB per GPU is full sharding',
             ],
             'README.md': [
                 'projects {step} s a step against {full} s',
             ],
         }),
    ('the convergence runs\' time', _BENCH, _run_time, {
        _TOOLS: ['about {minutes} minutes a run on 2 busy cores'],
    }),
    ('the tiny InternViT recipe\'s mIoU', _BENCH, _convergence, {
        _VIT: ['(mIoU about {tiny_vit:.0f} after its 200 iterations'],
        _FSDP2: ['(DDP: about {tiny_vit:.0f})'],
    }),
)


@pytest.mark.parametrize(
    'what, source, figures, quotes', _REPEATED, ids=[q[0] for q in _REPEATED])
def test_a_repeated_figure_is_quoted_from_one_page(what, source, figures,
                                                   quotes):
    """One source for each figure the pages repeat: every quote reads as
    its source page has it, to the digit the quote gives."""
    values = figures(_read(osp.join(ROOT, source)))
    drifted = []
    for page, sentences in quotes.items():
        text = _flat(page)
        for sentence in sentences:
            quote = sentence.format(**values)
            pattern = re.escape(quote).replace(re.escape('…'), r'[^|]*')
            if not re.search(pattern, text):
                drifted.append(f'{page}: {quote!r}')
    assert not drifted, f'{what}, as {source} has it, is not quoted in ' + \
        '; '.join(drifted)


def test_the_link_calibration_is_only_on_the_benchmarks_page():
    """The link calibration's figures belong to one run, on one page."""
    calibration = re.compile(r'\d\.\d\d-\d\.\d\d of (it|the set rate)')
    for page in PAGES:
        if calibration.search(_read(page)):
            assert page.endswith('benchmarks.md'), _rel(page)


def test_the_auto_example_is_what_the_code_prints_for_its_table():
    """The ``auto`` log example in the hooks guide, regenerated: its
    table's medians fed to the trials with ``auto``'s defaults give the
    same pick, the same iteration, the same lines (the example once said
    "at least 0% faster asked" from a test's ``min_gain=0``)."""
    from mmcv_custom.comm.auto import (AutoTrials, auto_candidates,
                                       check_auto_cfg)
    page = osp.join(ROOT, 'docs', 'en', 'user_guides', 'comm_hooks.md')
    text = _read(page)
    match = re.search(r'^( *)```text\n(\1comm_hook auto: chose.*?)^\1```\n',
                      text, re.M | re.S)
    assert match, 'no auto log example'
    lines = [line.strip() for line in match.group(2).splitlines()]
    header, shown = lines[0], lines[1:]
    settings = check_auto_cfg(dict(type='auto'))
    candidates = auto_candidates(settings['max_loss'], two_level=False)
    step_s = {}
    for line in shown:
        row = re.match(r'\*? ?(.+?)\s+\w+\s+(\d+\.\d+) s \(', line)
        if row:
            step_s[row.group(1)] = float(row.group(2))
    assert sorted(step_s) == sorted(c.key for c in candidates), step_s
    trials = AutoTrials(candidates, settings, [2, 0])
    while not trials.step_done(step_s[trials.trying.key]):
        pass
    decision = trials.decision
    assert header == (
        f'comm_hook auto: chose {decision.key} ({decision.klass}) after '
        f'iteration {trials.iterations}, from the slowest rank\'s median '
        'step of each:')
    assert shown == [line.strip() for line in decision.lines()]
    after = ' '.join(text[match.end():].split())
    assert after.startswith('followed by the usual `Registered DDP '
                            'communication hook ...` line, `(chosen by '
                            f"comm_hook auto, dict(type='{decision.key}'))`")


def test_what_the_cost_model_assumes_is_what_it_uses():
    """The cost model's page states its hardware as the default ``--gpu``
    preset's figures, and its compute as the code estimates it now (the
    forward's FLOPs counted on the meta device, or a measured step), not
    the ``N T`` it once used for every model."""
    import argparse

    from mmcv_custom.analysis.cost.options import (GPU_PRESETS,
                                                   add_projection_options)
    parser = argparse.ArgumentParser()
    add_projection_options(parser)
    gpu = parser.get_default('gpu')
    preset = GPU_PRESETS[gpu]
    text = ' '.join(
        _section(
            _read(osp.join(ROOT, 'docs', 'en', 'notes', 'comm_cost_model.md')),
            'What is assumed').split())
    assert (f'the `--gpu` preset (`{gpu}` by default: {preset.tflops:g} '
            f'TFLOP/s achieved, memory passes over {preset.hbm_tbps:g} TB/s '
            f'of HBM, {preset.intra_gbps:g} Gbit/s of NVLink a direction, '
            'PowerSGD\'s low-rank products at '
            f'{preset.matmul_tflops:g} TFLOP/s') in text, text
    for words in ('the whole model\'s forward FLOPs, counted on the meta '
                  'device', '`2 N T` only where the forward cannot be '
                  'counted', '`--backward-s` and `--compute-step-s`',
                  '`--from-log`'):
        assert words in text, words
