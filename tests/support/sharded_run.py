"""A model sharded by torch's distributed engine, inspected by hookcli: run under torchrun (gloo,
CPU), or with --single as the oracle — the same model unsharded in one process on the global
input. Each writes its report's JSON (rank 0 alone, sharded) to
OUT/<kind>.<sharded|single>.json.

    python -m torch.distributed.run --nproc_per_node 2 sharded_run.py OUT KIND
    python sharded_run.py OUT KIND --single

KIND: `tp` (an MLP: ColwiseParallel then RowwiseParallel), `tp-open` (its first Linear and the
ReLU only: the ReLU's output is a shard no parallel style declares), `fsdp-dp` (FSDP2's
fully_shard on each Linear and the root, each rank on its own rows of the batch: data parallel),
`2d` (FSDP2 over the `dp` dimension of a (2, world/2) mesh, the tensor-parallel MLP over its
`tp` dimension; each data-parallel index on its own rows), `ddp` (DistributedDataParallel, each
rank on its own rows), `fsdp-nan` (as fsdp-dp, a NaN in rank 1's rows at the watched run's step
1), `uneven` (DDP over a model whose last Linear runs on rank 1 only; grads alone), `branch`
(FSDP2 over a model that sends rank 0's rows through one Linear and rank 1's through another of
the same shape; inspect alone; then `check`'s per-channel rules on the MLP under FSDP2, and a
watched run of the MLP, its last Linear ColwiseParallel handing on a DTensor, whose loss
`loss_parallel` makes and `w.loss` takes), `sp`
(sequence
parallel: the MLP and a LayerNorm, each rank on its block of rows: ColwiseParallel gathers them,
RowwiseParallel reduce-scatters its output back into blocks, SequenceParallel norms each block),
`tp-emb` (a token embedding before the MLP, RowwiseParallel as torchtitan plans it: its output a
partial sum whose mask the style's own reduction needs after hookcli's hook has read it),
`tp-last` (the last Linear ColwiseParallel: the model's output is each rank's columns, handed on
as a plain tensor; grads' target is `top1`, over every column), `tp-shared` and `fsdp-shared`
(a gated MLP whose input both `gate` and `up` read: Colwise, Colwise, Rowwise; FSDP2's
fully_shard on each, each rank on its own rows: each one's input gradient is the whole
derivative, through both).
Each:
`grads` of the summed output (OUT/NAME.json), then three steps of SGD under `hookcli.watch`
(OUT/NAME.jsonl; sharded, each rank its own log).
"""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

import hookcli
from hookcli.errors import UsageError

IN, HIDDEN, OUT = 8, 32, 8


def model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, OUT))


class Gated(nn.Module):
    """A gated MLP: its input read by two Linears (their input gradients: both paths')."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.pre = nn.Linear(IN, IN)  # (what gate and up read: an activation, not the input)
        self.gate, self.up = nn.Linear(IN, HIDDEN), nn.Linear(IN, HIDDEN)
        self.down = nn.Linear(HIDDEN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.pre(x)
        return self.down(nn.functional.silu(self.gate(h)) * self.up(h))


def batch(kind: str = "") -> torch.Tensor:
    torch.manual_seed(1)
    return torch.randint(0, VOCAB, (6, 5)) if kind == "tp-emb" else torch.randn(6, IN)


VOCAB = 50  # tp-emb's embedding


def step_batch(kind: str, step: int) -> torch.Tensor:
    """The watched run's batch at `step`."""
    return (batch(kind) + step) % VOCAB if kind == "tp-emb" else batch() * (step + 1)


def sharded(kind: str, m: nn.Sequential) -> nn.Sequential:
    from torch.distributed.device_mesh import init_device_mesh

    world = torch.distributed.get_world_size()
    if kind == "2d":  # data parallel (FSDP2) over tensor parallel: a (dp, tp) mesh
        from torch.distributed.fsdp import fully_shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        grid = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("dp", "tp"))
        parallelize_module(m, grid["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
        fully_shard(m, mesh=grid["dp"])
        return m
    if kind == "ddp":  # DistributedDataParallel: replicated weights, averaged gradients
        return nn.parallel.DistributedDataParallel(m)  # type: ignore[return-value]
    mesh = init_device_mesh("cpu", (world,))
    if kind == "sp":
        from torch.distributed.tensor import Shard
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            SequenceParallel,
            parallelize_module,
        )

        plan = {
            "0": ColwiseParallel(input_layouts=Shard(0)),
            "2": RowwiseParallel(output_layouts=Shard(0)),
            "3": SequenceParallel(sequence_dim=0),
        }
        parallelize_module(m, mesh, plan)  # type: ignore[arg-type]
        return m
    if kind.startswith("tp"):
        from torch.distributed.tensor import Replicate
        from torch.distributed.tensor.parallel import (
            ColwiseParallel,
            RowwiseParallel,
            parallelize_module,
        )

        plans: dict[str, dict[str, Any]] = {
            "tp-shared": {
                "gate": ColwiseParallel(), "up": ColwiseParallel(), "down": RowwiseParallel()
            },
            "tp-emb": {
                "0": RowwiseParallel(input_layouts=Replicate()), "1": ColwiseParallel(),
                "3": RowwiseParallel(),
            },
            "tp-last": {"0": ColwiseParallel(output_layouts=Replicate()), "2": ColwiseParallel()},
        }  # fmt: skip
        plan = plans.get(kind, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        names = {n for n, _ in m.named_children()}  # (tp-open: the first two modules only)
        parallelize_module(m, mesh, {k: v for k, v in plan.items() if k in names})
    else:
        from torch.distributed.fsdp import fully_shard

        for part in ("pre", "gate", "up", "down") if kind == "fsdp-shared" else ("0", "2"):
            fully_shard(m.get_submodule(part), mesh=mesh)
        fully_shard(m, mesh=mesh)
    return m


class Uneven(nn.Module):
    """The MLP, then a Linear that runs on rank 1 only: the ranks measure other tensors."""

    def __init__(self) -> None:
        super().__init__()
        self.mlp, self.extra = model(), nn.Linear(OUT, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.mlp(x)
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        return self.extra(y) if rank == 1 else y


class Branch(nn.Module):
    """Rows of positive first feature through `p`, others through `q`: a data-dependent
    choice (an MoE's), each rank's batch taking another branch here."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.p, self.q = nn.Linear(IN, OUT), nn.Linear(IN, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.p(x) if bool(x[0, 0] > 0) else self.q(x)


def _loss_parallel(log: Path) -> list[float]:
    """Three watched SGD steps of the MLP (Colwise, Rowwise, then a Colwise head handing
    on a DTensor), each loss from cross_entropy under loss_parallel given to `w.loss`;
    returns the same steps' losses run unsharded (the oracle)."""
    import copy

    import torch.nn.functional as F
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        RowwiseParallel,
        loss_parallel,
        parallelize_module,
    )

    m = model().append(nn.Linear(OUT, 10))
    plain = copy.deepcopy(m)
    head = ColwiseParallel(
        input_layouts=Replicate(), output_layouts=Shard(-1), use_local_output=False
    )
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    parallelize_module(m, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel(), "3": head})
    want = []
    for net in (m, plain):
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        with hookcli.watch(net, optimizer=opt, log=log if net is m else None) as w:
            for step in range(3):
                torch.manual_seed(10 + step)
                x, y = torch.randn(6, IN), torch.randint(0, 10, (6,))
                opt.zero_grad()
                with loss_parallel() if net is m else contextlib.nullcontext():
                    loss = F.cross_entropy(net(x), y)
                    w.loss(loss)
                    loss.backward()
                opt.step()
                if net is plain:
                    want.append(float(loss))
    return want


def main() -> None:
    out, kind = Path(sys.argv[1]), sys.argv[2]
    single = "--single" in sys.argv
    if kind == "branch":  # FSDP2; inspect only, each rank's report and its own rows
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch.distributed.init_process_group("gloo")
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        m = Branch()
        fully_shard(m, mesh=init_device_mesh("cpu", (world,)))
        x = batch()[rank::world].abs() * (1 if rank == 0 else -1)
        report = hookcli.inspect(m, x, topk=0)
        with torch.no_grad():
            own = (m.p if rank == 0 else m.q)(x)
        data = {"report": report.to_dict(), "own_mean": float(own.double().mean())}
        mlp = model()
        fully_shard(mlp, mesh=init_device_mesh("cpu", (world,)))
        checked = hookcli.check(mlp, batch()[rank::world], fail_on=["massive"], max_kurtosis=3.0)
        data["check"] = {"exit": hookcli.exit_code(checked), **checked.to_dict()}
        # grads in the middle of the user's gradient accumulation: refused, nothing touched
        refused = []
        mlp.set_requires_gradient_sync(False)
        mlp(batch()[rank::world]).sum().backward()
        for sync in (False, True):  # (then: sync on again, the micro-batch not yet reduced)
            mlp.set_requires_gradient_sync(sync)
            try:
                hookcli.grads(mlp, batch()[rank::world], target="sum", topk=0)
            except UsageError as exc:
                refused.append(str(exc))
        ddp = nn.parallel.DistributedDataParallel(model())
        with ddp.no_sync():
            try:
                hookcli.grads(ddp, batch()[rank::world], target="sum", topk=0)
            except UsageError as exc:
                refused.append(str(exc))
        data["refused"] = refused
        part = model()  # FSDP2 on the first Linear alone: the others' gradients are the rank's
        fully_shard(part[0], mesh=init_device_mesh("cpu", (world,)))
        data["part_notes"] = hookcli.grads(part, batch()[rank::world], topk=0).notes
        # every row on rank 0, none on rank 1: the oracle, the plain model on those rows, its
        # gradient halved (FSDP averages over the two ranks)
        whole, plain = model(), model()
        for shard in (whole[0], whole[2], whole):  # (each Linear its own pre-forward)
            fully_shard(shard, mesh=init_device_mesh("cpu", (world,)))
        rows = batch()[: 6 if rank == 0 else 0]
        data["empty_rank"] = hookcli.grads(whole, rows, target="sum", topk=0).to_dict()
        # 4 rows and 2 (8 wide: a part of 16 elements lists them, one of 32 does not)
        four_two = batch()[:4] if rank == 0 else batch()[4:]
        data["four_two"] = hookcli.grads(whole, four_two, target="sum", topk=0).to_dict()
        (plain(batch()).sum() / world).backward()
        data["empty_rank_want"] = {
            n: [float(p.norm()), float(p.grad.norm())] for n, p in plain.named_parameters()
        }
        data["losses"] = _loss_parallel(out / "branch-loss.jsonl")  # (.rankN added)
        (out / f"branch.rank{rank}.json").write_text(json.dumps(data))
        _leave()
        return
    if kind == "uneven":  # DDP; grads only, rank 0's report
        torch.distributed.init_process_group("gloo")
        ddp = nn.parallel.DistributedDataParallel(Uneven(), find_unused_parameters=True)
        rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        report = hookcli.grads(ddp, batch()[rank::world], target="sum", topk=0)
        if rank == 0:
            (out / "uneven.sharded.json").write_text(json.dumps(report.to_dict()))
        _leave()
        return
    m = model() if kind != "tp-open" else nn.Sequential(*list(model())[:2])
    if kind == "tp-emb":
        m.insert(0, nn.Embedding(VOCAB, IN))
    if kind.endswith("-shared"):
        m = Gated()  # type: ignore[assignment]
    if kind == "sp":  # (weights not all ones: a plain norm's outputs sum to 0, its gradient too)
        m.append(nn.LayerNorm(OUT))
        with torch.no_grad():
            m[3].weight.copy_(torch.linspace(0.5, 1.5, OUT))
    if not single:
        torch.distributed.init_process_group("gloo")
        m = sharded(kind, m)
    rank = torch.distributed.get_rank() if not single else 0
    world = torch.distributed.get_world_size() if not single else 1
    name = f"{kind}.{'single' if single else 'sharded'}"
    names = [str(i) for i in range({"sp": 4, "tp-open": 2, "tp-emb": 4}.get(kind, 3))]
    if kind.endswith("-shared"):
        names = ["pre", "gate", "up", "down"]
    # (inspect and grads hook the DDP wrapper's module as it names it; watch unwraps it)
    layers = [f"module.{n}" for n in names] if kind == "ddp" and not single else names

    def mine(x: torch.Tensor) -> torch.Tensor:  # data parallel: each rank its rows
        if kind == "2d" and not single:  # each data-parallel index (rank // tp) its rows
            return x[rank // (world // 2) :: 2]
        if kind == "sp":  # each rank its block of rows (Shard(0))
            return x.chunk(world)[rank]
        return x[rank::world] if kind in ("fsdp-dp", "ddp", "fsdp-nan", "fsdp-shared") else x

    hist = 4 if kind == "fsdp-dp" else 0  # (histograms do not merge: left out, said)
    target = "top1" if kind == "tp-last" else "sum"
    grad_in = kind in ("fsdp-dp", "ddp")  # (the input's gradient: merged, ÷ W as the rest)
    report = hookcli.grads(
        m, mine(batch(kind)), layers=layers, target=target, topk=0, hist=hist, input_grad=grad_in
    )
    more: dict[str, Any] = {}
    if kind == "tp-last":  # a loss against a plain target, and the predictions: the whole's
        x = mine(batch(kind))
        more["mse"] = hookcli.grads(m, x, layers=layers, loss="mse:randn:6x8", topk=3).to_dict()
    # the total gradient norm the training would clip: clip_grad_norm_'s, on the same pass
    m(mine(batch(kind))).sum().backward()
    total: Any = None
    if kind != "tp-shared":  # (its plain `pre` beside DTensors: clip_grad_norm_ refuses the mix)
        total = torch.nn.utils.clip_grad_norm_(m.parameters(), max_norm=1e9)
        total = float(total.full_tensor() if hasattr(total, "full_tensor") else total)
    m.zero_grad(set_to_none=True)
    if rank == 0:
        data = report.to_dict() | {"clip_grad_norm": total} | more
        (out / f"{name}.json").write_text(json.dumps(data))
    # three steps of SGD, each watched; rank 0's log
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    with hookcli.watch(m, optimizer=opt, layers=names, log=out / f"{name}.jsonl"):
        for step in range(3):
            opt.zero_grad()
            x = mine(step_batch(kind, step))
            if kind == "fsdp-nan" and step == 1 and rank == 1:
                x[0, 0] = float("nan")  # rank 1's rows only
            # a mean over the rank's rows: FSDP averages; sequence parallel sums its blocks'
            (m(x).sum() / (len(x) * (world if kind == "sp" else 1))).backward()
            opt.step()
    if not single:
        _leave()


def _leave() -> None:
    """Every rank here before any takes the group down: a rank that destroyed its gloo group
    while another was still in a collective was seen to abort it ("terminate called without
    an active exception"), now and then, on a busy machine."""
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
