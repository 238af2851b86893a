from mmcv_custom.testing import run_ranks  # noqa: F401
