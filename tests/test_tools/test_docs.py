"""The README and the pages under docs/en/: every relative link resolves,
every repository path they show exists, the README stays a two-minute
read, and its hook table names every built-in hook. Reads files only."""
import glob
import os.path as osp
import re

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


def test_repeated_times_are_quoted_from_one_page():
    """One source for each time the pages repeat (issue 31): the suite's
    (docs/en/notes/tests.md, as measured), the demo's idle wall time and
    the environment's build (docs/en/get_started.md); the link
    calibration's figures only on the benchmarks page."""
    tests_page = ' '.join(
        _read(osp.join(ROOT, 'docs', 'en', 'notes', 'tests.md')).split())
    minutes, seconds = map(
        int,
        re.search(
            r'`\.ci/run` from a fresh clone on this shared 2-core '
            r'host, idle, [^:]*: (\d+) min (\d+) s', tests_page).groups())
    suite = round(minutes + seconds / 60)
    start = ' '.join(
        _read(osp.join(ROOT, 'docs', 'en', 'get_started.md')).split())
    readme = ' '.join(_read(README).split())
    assert f'suite takes about {suite} minutes on 2 cores' in readme
    assert f'(about {suite} minutes on 2 idle cores' in start
    demo = re.search(r'(\d+) s when idle\)', start).group(1)
    assert f'in about {demo} s on an idle 2-core machine' in readme
    build = re.search(r'about (\d+) minutes on 2 cores the first time',
                      start).group(1)
    assert f'(about {build} minutes on 2 cores: mmcv is' in readme
    calibration = re.compile(r'\d\.\d\d-\d\.\d\d of (it|the set rate)')
    for page in PAGES:
        if calibration.search(_read(page)):
            assert page.endswith('benchmarks.md'), _rel(page)
