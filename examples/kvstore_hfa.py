"""HFA through the KVStore, as GeoMX users write it: every K1 steps, push param / num_workers
and pull the average (all pushes before the pulls, so the whole model travels in one round).
The local server counts K2 and sends every K2-th average on to the global servers.

    MXNET_KVSTORE_USE_HFA=1 MXNET_KVSTORE_HFA_K1=4 MXNET_KVSTORE_HFA_K2=2 \
        mpirun -n 9 python examples/kvstore_hfa.py --steps 200
"""

import argparse

import torch

import geompi.kv
from geompi.config import make_config
from geompi.data import ShardLoader, evaluate, load_dataset, shard_indices
from geompi.models import build_model

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.05)
args = parser.parse_args()

k1 = make_config().k1  # GEOMPI_HFA_K1 or MXNET_KVSTORE_HFA_K1
kv = geompi.kv.create("dist_sync")
torch.manual_seed(0)
ds = load_dataset("digits")
shard = shard_indices(len(ds.y_train), kv.num_all_workers, kv.rank, seed=0)
loader = ShardLoader(ds.x_train, ds.y_train, shard, args.batch_size, seed=0, shard=kv.rank)
model = build_model("cnn", ds.input_shape, ds.num_classes)
params = list(model.parameters())
opt = torch.optim.SGD(params, lr=args.lr, momentum=0.9)

for idx, p in enumerate(params):
    kv.init(idx, p.data)
    kv.pull(idx, out=p.data)
kv.wait()

loss_fn = torch.nn.CrossEntropyLoss()
for step in range(1, args.steps + 1):
    x, y = loader.next_batch()
    opt.zero_grad()
    loss_fn(model(x), y).backward()
    opt.step()
    if step % k1 == 0:  # every push first, then the pulls: one round for the whole model
        for idx, p in enumerate(params):
            kv.push(idx, p.data / kv.num_workers, priority=-idx)
        for idx, p in enumerate(params):
            kv.pull(idx, out=p.data, priority=-idx)
        kv.wait()

acc, _ = evaluate(model, ds.x_test, ds.y_test)
digest = float(sum(p.detach().double().sum() for p in params))
print(f"kvstore_hfa: worker {kv.rank} test_acc={acc:.4f} param_sum={digest:.10f}", flush=True)
kv.close()
