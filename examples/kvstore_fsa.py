"""FSA written the way a GeoMX user writes it: push and pull per parameter through the KVStore.

    mpirun -n 9 python examples/kvstore_fsa.py --steps 200

Server ranks serve inside ``geompi.kv.create`` and exit there; the rest of this file runs on the
workers. The master worker sets the global servers' optimizer and its initial parameters reach
every worker through ``kv.init``.
"""

import argparse

import torch

import geompi.kv
import geompi.optim
from geompi.data import ShardLoader, evaluate, load_dataset, shard_indices
from geompi.models import build_model

parser = argparse.ArgumentParser()
parser.add_argument("--steps", type=int, default=200)
parser.add_argument("--batch-size", type=int, default=16)
parser.add_argument("--lr", type=float, default=0.05)
parser.add_argument("--kv", default="dist_sync", help="dist_sync, or dist_async (MixedSync)")
parser.add_argument("--dcasgd", action="store_true", help="DCASGD at the global servers")
args = parser.parse_args()

kv = geompi.kv.create(args.kv)
torch.manual_seed(0)
ds = load_dataset("digits")
shard = shard_indices(len(ds.y_train), kv.num_all_workers, kv.rank, seed=0)
loader = ShardLoader(ds.x_train, ds.y_train, shard, args.batch_size, seed=0, shard=kv.rank)
model = build_model("cnn", ds.input_shape, ds.num_classes)
params = list(model.parameters())

if kv.is_master_worker:
    if args.dcasgd:
        kv.set_optimizer(geompi.optim.DCASGD(lr=args.lr))
    else:
        kv.set_optimizer(geompi.optim.SGD(lr=args.lr, momentum=0.9))
for idx, p in enumerate(params):
    kv.init(idx, p.data)
    kv.pull(idx, out=p.data)
kv.wait()

loss_fn = torch.nn.CrossEntropyLoss()
for _ in range(args.steps):
    x, y = loader.next_batch()
    model.zero_grad()
    loss = loss_fn(model(x), y)
    loss.backward()
    for idx, p in enumerate(params):
        # The servers sum the pushes: scale so that the sum is the mean gradient.
        kv.push(idx, p.grad / kv.num_all_workers, priority=-idx)
    for idx, p in enumerate(params):
        kv.pull(idx, out=p.data, priority=-idx)
    kv.wait()

kv.close()  # with dist_async: waits for every datacenter; pull then gives the final model
for idx, p in enumerate(params):
    kv.pull(idx, out=p.data)
acc, _ = evaluate(model, ds.x_test, ds.y_test)
digest = float(sum(p.detach().double().sum() for p in params))
print(f"kvstore_fsa: worker {kv.rank} test_acc={acc:.4f} param_sum={digest:.10f}", flush=True)
