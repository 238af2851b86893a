"""Write the few-shot training subsets of ADE20K as split files.

    python tools/dataset_converters/ade20k_fewshot_splits.py \\
        --data-root data/ade/ADEChallengeData2016

writes ``splits/train_1of{1,2,4,8,16}.txt`` under the data root: one image
name (without extension) per line, MMSegmentation's ``ann_file`` format. The
order comes from a seeded shuffle of the sorted file names, and each subset
is a prefix of it, so 1/16 is inside 1/8 and so on, and the same seed gives
the same files on every machine.
"""
import argparse
import os
import os.path as osp
import random

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


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument('--data-root', default='data/ade/ADEChallengeData2016')
    parser.add_argument('--img-dir', default='images/training')
    parser.add_argument('--suffix', default='.jpg')
    parser.add_argument('--seed', type=int, default=0)
    args = parser.parse_args()
    for fraction, path in write_splits(args.data_root, args.img_dir,
                                       args.suffix, args.seed).items():
        with open(path) as f:
            print(f'1/{fraction}: {sum(1 for _ in f)} images -> {path}')


if __name__ == '__main__':
    main()
