"""A small MMEngine model and synthetic data to try the plugin on a CPU.

Nothing here is needed to use the communication hooks; it gives the
MMEngine-only demo (``configs/demo/``, run with ``tools/demo.py --config``)
and the runner-level tests a real MMEngine ``BaseModel`` that trains in
seconds on two gloo ranks. (``make demo`` trains the toy segmenter
instead.) Registered in MMEngine's root registries, so
configs use ``type='MLPRegressor'`` and ``type='SyntheticRegressionDataset'``
with ``custom_imports=dict(imports=['mmcv_custom.demo'])``.
"""
from typing import Optional

import torch
from mmengine.evaluator import BaseMetric
from mmengine.model import BaseModel
from mmengine.registry import DATASETS, METRICS, MODELS
from torch import nn
from torch.utils.data import Dataset

__all__ = ['MLPRegressor', 'SyntheticRegressionDataset', 'RegressionMSE']


@MODELS.register_module()
class MLPRegressor(BaseModel):
    """A multi-layer perceptron trained with mean squared error.

    Args:
        in_features (int): Input width. Defaults to 32.
        hidden (int): Hidden width. Defaults to 256.
        depth (int): Number of hidden layers. Defaults to 3.
        out_features (int): Output width. Defaults to 8.
    """

    def __init__(self,
                 in_features: int = 32,
                 hidden: int = 256,
                 depth: int = 3,
                 out_features: int = 8,
                 data_preprocessor=None) -> None:
        super().__init__(data_preprocessor=data_preprocessor)
        layers, width = [], in_features
        for _ in range(depth):
            layers += [nn.Linear(width, hidden), nn.GELU()]
            width = hidden
        layers.append(nn.Linear(width, out_features))
        self.net = nn.Sequential(*layers)

    def forward(self, inputs, data_samples=None, mode: str = 'tensor'):
        if isinstance(inputs, (list, tuple)):
            inputs = torch.stack(inputs)
        outputs = self.net(inputs)
        if mode == 'loss':
            if isinstance(data_samples, (list, tuple)):
                data_samples = torch.stack(data_samples)
            return dict(loss=nn.functional.mse_loss(outputs, data_samples))
        if mode == 'predict':
            return list(outputs)
        return outputs


@DATASETS.register_module()
class SyntheticRegressionDataset(Dataset):
    """Inputs and targets of a fixed random nonlinear function.

    ``function_seed`` draws the function (a random projection followed by
    tanh), ``seed`` the inputs: a training and a validation set with the
    same ``function_seed`` and different ``seed`` are two samples of one
    task, so the validation error measures how well the model learned the
    function. Deterministic, so every rank and every run sees the same
    data.

    Args:
        num_samples (int): Dataset length. Defaults to 512.
        in_features (int): Input width. Defaults to 32.
        out_features (int): Target width. Defaults to 8.
        seed (int): Seed of the inputs. Defaults to 0.
        function_seed (int, optional): Seed of the function. Defaults to
            None: the projection is drawn from ``seed``'s generator after
            the inputs, as before this argument existed (the data of
            existing runs stays the same), which makes the function depend
            on ``seed`` and ``num_samples``. Set it wherever two datasets
            must share their function.
    """
    METAINFO: dict = dict()

    def __init__(self,
                 num_samples: int = 512,
                 in_features: int = 32,
                 out_features: int = 8,
                 seed: int = 0,
                 function_seed: Optional[int] = None) -> None:
        gen = torch.Generator().manual_seed(seed)
        self.inputs = torch.randn(num_samples, in_features, generator=gen)
        if function_seed is not None:
            # Offset, so that seed == function_seed does not reuse the
            # inputs' random numbers as the projection.
            gen = torch.Generator().manual_seed(2**32 + function_seed)
        proj = torch.randn(in_features, out_features, generator=gen)
        self.targets = torch.tanh(self.inputs @ proj / in_features**0.5)

    @property
    def metainfo(self) -> dict:
        return self.METAINFO

    def __len__(self) -> int:
        return len(self.inputs)

    def __getitem__(self, index: int) -> dict:
        return dict(
            inputs=self.inputs[index], data_samples=self.targets[index])


@METRICS.register_module()
class RegressionMSE(BaseMetric):
    """Mean squared error of :class:`MLPRegressor` predictions."""
    default_prefix = 'regression'

    def process(self, data_batch: dict, data_samples) -> None:
        targets = data_batch['data_samples']
        for pred, target in zip(data_samples, targets):
            self.results.append(float(((pred - target)**2).mean()))

    def compute_metrics(self, results: list) -> dict:
        return dict(mse=sum(results) / max(len(results), 1))
