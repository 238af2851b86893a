"""Write the few-shot training subsets of ADE20K as split files.

    python tools/dataset_converters/ade20k_fewshot_splits.py \\
        --data-root data/ade/ADEChallengeData2016

writes ``splits/train_1of{1,2,4,8,16}.txt`` under the data root: one image
name (without extension) per line, MMSegmentation's ``ann_file`` format. The
order comes from a seeded shuffle of the sorted file names, and each subset
is a prefix of it, so 1/16 is inside 1/8 and so on, and the same seed gives
the same files on every machine.

A data root without the images (or without any ``--suffix`` file among
them) is a usage error, one line and exit code 2; a split that cannot be
written, one line and exit code 1.
"""
import argparse
import os
import os.path as osp
import random
import sys

FRACTIONS = (1, 2, 4, 8, 16)


def write_splits(data_root: str,
                 img_dir: str = 'images/training',
                 suffix: str = '.jpg',
                 seed: int = 0,
                 fractions=FRACTIONS) -> dict:
    """Write the split files; returns ``{fraction: path}``."""
    folder = osp.join(data_root, img_dir)
    if not osp.isdir(folder):
        raise FileNotFoundError(
            f'{folder} does not exist: --data-root should be the folder '
            'holding images/training (e.g. data/ade/ADEChallengeData2016)')
    names = sorted(f[:-len(suffix)] for f in os.listdir(folder)
                   if f.endswith(suffix))
    if not names:
        raise FileNotFoundError(f'no *{suffix} images in {folder}')
    random.Random(seed).shuffle(names)
    out_dir = osp.join(data_root, 'splits')
    os.makedirs(out_dir, exist_ok=True)
    written = {}
    for fraction in fractions:
        count = max(1, len(names) // fraction)
        path = osp.join(out_dir, f'train_1of{fraction}.txt')
        with open(path, 'w') as f:
            f.write('\n'.join(sorted(names[:count])) + '\n')
        written[fraction] = path
    return written


def parse_args(argv=None) -> argparse.Namespace:
    """The command line, checked: the image folder exists and holds
    ``--suffix`` files, or a usage error (exit code 2) says what to do."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        '--data-root',
        default='data/ade/ADEChallengeData2016',
        help='the ADE20K folder holding images/training (default: '
        'data/ade/ADEChallengeData2016, where MMSegmentation expects it)')
    parser.add_argument(
        '--img-dir',
        default='images/training',
        help='training images, under the data root (default: '
        'images/training)')
    parser.add_argument(
        '--suffix', default='.jpg', help='image suffix (default: .jpg)')
    parser.add_argument(
        '--seed', type=int, default=0, help='shuffle seed (default: 0)')
    args = parser.parse_args(argv)
    folder = osp.join(args.data_root, args.img_dir)
    if not osp.isdir(args.data_root):
        parser.error(f'--data-root {args.data_root}: no such folder; give '
                     f'the ADE20K folder that holds {args.img_dir} '
                     '(ADEChallengeData2016, unpacked where MMSegmentation '
                     'expects it: data/ade/ADEChallengeData2016)')
    if not osp.isdir(folder):
        parser.error(f'--data-root {args.data_root}: no {args.img_dir} '
                     'in it; give the ADE20K folder that holds it '
                     '(ADEChallengeData2016), or its place with --img-dir')
    if not any(f.endswith(args.suffix) for f in os.listdir(folder)):
        parser.error(f'no *{args.suffix} images in {folder} (wrong '
                     '--suffix or --img-dir?)')
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        written = write_splits(args.data_root, args.img_dir, args.suffix,
                               args.seed)
    except OSError as e:
        # A data root that cannot be written (read-only, full).
        where = f': {e.filename}' if e.filename else ''
        print(
            f'{osp.basename(__file__)}: error: cannot write the splits'
            f'{where} ({e.strerror or e})',
            file=sys.stderr)
        return 1
    for fraction, path in written.items():
        with open(path) as f:
            print(f'1/{fraction}: {sum(1 for _ in f)} images -> {path}')
    return 0


if __name__ == '__main__':
    sys.exit(main())
