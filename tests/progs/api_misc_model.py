"""The BatchNorm model of tests/progs/api_misc.py, importable by the tests."""

from torch import nn

from tests.progs.api_common import IN, OUT


class BNNet(nn.Module):
    """A BatchNorm on the raw input (its running mean depends on the data only), then an MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.bn = nn.BatchNorm1d(IN, momentum=0.2)
        self.body = nn.Sequential(nn.Linear(IN, 16), nn.Tanh(), nn.Linear(16, OUT))

    def forward(self, x):
        return self.body(self.bn(x))
