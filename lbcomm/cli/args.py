"""lbcomm-bench's command line: the parser and the help in a user's words. The value types
are in argtypes.py, the checks of the arguments together (done before a rank starts or a
cluster is built) in checks.py."""
from __future__ import annotations

import argparse
from typing import Optional

from .argtypes import (_block_size, _bytes_per_s, _choices, _comma, _float_over, _int_at_least, _positive, _rate,
                       _rate_or_none, _seconds, _sizes, _typed)
from .launch import BACKENDS
from .schema import ADVISE_ROW_FIELDS, ALLREDUCE_ROW_FIELDS, TRAIN_ROW_FIELDS, describe_fields
from .units import parse_params, parse_size, parse_time

__all__ = ["build_parser", "BACKENDS"]

DESCRIPTION = """\
Benchmarks of lbcomm's 1-bit compressed allreduce, on this machine or on an emulated
cluster of network namespaces with shaped links (as root):

  allreduce   time fp32, fp16 and 1-bit allreduce side by side, nccl-tests style
  train       training-step throughput of a small transformer LM with each method
  model       the latency-bandwidth cost model, checked against measured runs
  advise      will 1-bit help my run? predicted step times for a model and a cluster
  race        wall-clock time to a target validation loss, lbcomm against its peers

examples:
  lbcomm-bench allreduce --world-size 4 --sizes 1M,8M --methods fp32,fp16,onebit
  sudo lbcomm-bench allreduce --world-size 4 --bandwidth 1gbit --sizes 8M --plot ar.png
  torchrun --nproc-per-node 4 -m lbcomm.cli allreduce --sizes 8M
  mpirun -np 4 python -m lbcomm.cli allreduce --backend mpi --sizes 8M
  sudo lbcomm-bench train --bandwidth 1gbit,10gbit --plot train.png
  sudo lbcomm-bench model --bandwidth 1gbit --world-sizes 2,4
  lbcomm-bench advise --params 350M --nodes 8 --bandwidth 10gbit --step-time 400ms
  sudo lbcomm-bench race --bandwidth 1gbit,100mbit --plot race.png

Sizes count fp32 ELEMENTS: 4K = 4096 elements, 8M = 8 Mi elements (32 MiB); a B suffix
gives bytes instead: 32MB (= 32MiB) is 8M elements. K, M, G are powers of 1024 either
way. Link rates are written as for tc: 1gbit, 100mbit (bits per second).
Run `lbcomm-bench COMMAND --help` for a command's options and its JSON fields."""



# ---------------------------------------------------------------------------- the parser


def _add_common(p: argparse.ArgumentParser, default_world: Optional[int]) -> None:
    p.add_argument("--world-size", type=_int_at_least(2), default=None,
                   help=f"ranks to start on this machine (default: {default_world}); leave it out under "
                        "torchrun or mpirun, which start the ranks themselves" if default_world else
                   "ranks of the measured runs: use --world-sizes")
    p.add_argument("--backend", choices=BACKENDS, default="gloo",
                   help="gloo (CPU tensors), nccl (CUDA tensors, one GPU per rank) or mpi (CPU tensors, ranks "
                        "started by mpirun; needs mpi4py and Open MPI) (default: gloo)")
    p.add_argument("--latency", type=_typed(parse_time, keep_text=True), default="50ms",
                   help="with --bandwidth: the longest a packet may wait in a link's queue (it bounds the queue "
                        "and adds no fixed delay) (default: 50ms)")
    p.add_argument("--burst", type=_typed(parse_size, keep_text=True), default="256kb",
                   help="with --bandwidth: bytes a link may send at once above its rate, at least one "
                        "Ethernet frame (1514 bytes); kb = 1024 bytes (default: 256kb)")
    p.add_argument("--threads", type=_positive, default=None,
                   help="torch threads per rank (default: cores / ranks on this machine, at least 1)")
    p.add_argument("--json", metavar="FILE", help="write the results as JSON (fields listed below)")
    p.add_argument("--plot", metavar="FILE.png", help="write a plot (needs matplotlib)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--timeout", type=_float_over(0, "number of seconds"), default=3600.0,
                   help="seconds before the ranks are stopped (default: 3600)")


def _add_nodes(p, what: str) -> None:
    """--nodes and --ranks-per-node of the allreduce and train benchmarks."""
    p.add_argument("--nodes", type=_int_at_least(1), default=None,
                   help="emulated nodes: world size = nodes x ranks per node; with --bandwidth the ranks of a "
                        "node share one network namespace (unshaped loopback) and the nodes are joined by shaped "
                        "links, whose interface counters give the bytes between nodes")
    p.add_argument("--ranks-per-node", type=_int_at_least(1), default=None,
                   help=f"ranks per node (consecutive ranks): {what} (default: 1)")


def _sub(sub, name: str, help: str, description: str, epilog: str = "") -> argparse.ArgumentParser:
    return sub.add_parser(name, help=help, description=description, epilog=epilog,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def _add_allreduce(sub) -> None:
    from .allreduce import METHODS as ALLREDUCE_METHODS

    ar = _sub(sub, "allreduce", "time fp32 / fp16 / 1-bit allreduce, nccl-tests style",
              "Time allreduce-to-mean of fp32 tensors: fp32 and fp16 ring allreduce against lbcomm's 1-bit "
              "compressed allreduce, side by side in one run. Every rank times every call; a call's time is "
              "the slowest rank's.",
              "JSON: schema, version, created, argv, config, host and rows; one row per size and method:\n"
              + describe_fields(ALLREDUCE_ROW_FIELDS))
    _add_common(ar, 4)
    ar.add_argument("--sizes", type=_sizes, default=_sizes("1M,8M,32M"),
                    help="comma-separated sizes in fp32 ELEMENTS (4K, 8M; K/M/G = 1024^n) or in bytes with a B "
                         "suffix (32MB = 8M elements) (default: 1M,8M,32M)")
    ar.add_argument("--methods", type=_choices(ALLREDUCE_METHODS, "method"), default=None,
                    help="comma-separated subset of fp32,fp16,onebit,hier; hier is the hierarchical call (fp32 "
                         "inside a node, 1 bit between nodes) (default: fp32,fp16,onebit, and hier with "
                         "--ranks-per-node > 1)")
    _add_nodes(ar, "the hier method groups them")
    ar.add_argument("--iters", type=_positive, default=20, help="timed iterations (default: 20)")
    ar.add_argument("--warmup", type=_int_at_least(0), default=3, help="untimed iterations first (default: 3)")
    ar.add_argument("--block-size", type=_block_size, default=2048,
                    help="onebit: elements per scale, a positive multiple of 32, or 'none' for one scale per "
                         "chunk (default: 2048)")
    ar.add_argument("--pieces", type=_positive, default=None,
                    help="onebit: cut each rank's chunk into this many pieces so that compression overlaps "
                         "the transfers; needs a block size (default: automatic, by size)")
    ar.add_argument("--bandwidth", type=_rate, default=None,
                    help="run the ranks in an emulated cluster with links of this rate per direction, e.g. "
                         "1gbit, 100mbit (needs root)")
    ar.set_defaults(command="allreduce")


def _add_train(sub) -> None:
    from .train import DEFAULT_NODE_METHODS as DEFAULT_NODE_TRAIN_METHODS
    from .train import FLAT_METHODS as FLAT_TRAIN_METHODS
    from .train import METHODS as TRAIN_METHODS
    from .train import NODE_METHODS as NODE_TRAIN_METHODS
    from .train import STATS_METHODS
    from .train import MIN_WARMUP_STEPS, MODEL_PRESETS

    tr = _sub(sub, "train", "data-parallel training-step throughput of a small transformer LM",
              "Training-step throughput of a small transformer LM: DDP with AdamW, torch's fp16 and PowerSGD "
              "gradient compression, lbcomm's 1-bit gradient hook, and lbcomm's 1-bit Adam in its compression "
              "stage, in one run per bandwidth.",
              "JSON: schema, version, created, argv, config, host, params and runs (one per bandwidth, with "
              "bandwidth, allreduce_s and rows); one row per method:\n" + describe_fields(TRAIN_ROW_FIELDS))
    _add_common(tr, 4)
    tr.add_argument("--bandwidth", type=_comma(_rate_or_none), default=None,
                    help="comma-separated link rates, one emulated cluster each (needs root); 'none' for "
                         "loopback (default: 1gbit,10gbit; none under torchrun)")
    tr.add_argument("--methods", type=_choices(TRAIN_METHODS + STATS_METHODS, "method"), default=None,
                    help=f"comma-separated subset of {','.join(TRAIN_METHODS)}; {','.join(NODE_TRAIN_METHODS)} "
                         f"need --ranks-per-node > 1 (default: {','.join(FLAT_TRAIN_METHODS)}; with nodes "
                         f"{','.join(DEFAULT_NODE_TRAIN_METHODS)}); also, never by default, "
                         f"{','.join(STATS_METHODS)} (to time the gradient-noise statistics: DDP with a plain Python "
                         "allreduce hook, the same with the statistics around it (exact, and from a sample of "
                         "coordinates), and 1-bit Adam with them; and the published compression-stage rules, "
                         "to time the robust defaults against them: the hook without per-coordinate weights and "
                         "with every parameter compressed, 1-bit Adam without its update bound)")
    _add_nodes(tr, "the HSDP mesh's shard dimension and the hierarchical hook's nodes")
    tr.add_argument("--preset", choices=sorted(MODEL_PRESETS), default="small",
                    help="model and batch preset (default: small); the options below override it")
    for name, what in (("vocab", "vocabulary"), ("d-model", "width"), ("layers", "blocks"), ("heads", "heads"),
                       ("seq-len", "tokens per sample"), ("batch", "samples per rank and step")):
        tr.add_argument(f"--{name}", type=_positive, default=None, help=what)
    tr.add_argument("--steps", type=_positive, default=4, help="timed steps per method and round (default: 4)")
    tr.add_argument("--rounds", type=_positive, default=3, help="interleaved rounds (default: 3)")
    tr.add_argument("--warmup-steps", type=_int_at_least(MIN_WARMUP_STEPS), default=10,
                    help=f"untimed steps per method first, at least {MIN_WARMUP_STEPS}; 1-bit Adam starts "
                         "compressing 2 steps before their end (default: 10)")
    tr.add_argument("--allreduce-iters", type=_positive, default=3,
                    help="iterations of the gradient-sized fp32 allreduce timed alone (default: 3)")
    tr.add_argument("--lr", type=_float_over(0, "learning rate"), default=1e-4,
                    help="learning rate (default: 1e-4)")
    tr.set_defaults(command="train")


def _add_model(sub) -> None:
    md = _sub(sub, "model", "latency-bandwidth cost model, checked against measured 2 and 4 rank runs",
              "The cost model of one allreduce of n fp32 elements on p ranks with links of B bit/s:\n\n"
              "  time = 2 (p-1) latency + bytes sent per rank / (B * 1448/1514) + local compute\n\n"
              "bytes: 2 (p-1)/p * 4n for the fp32 ring; the exact 1-bit bytes (sign bits, scales, headers).\n"
              "1448/1514: TCP payload of a full Ethernet frame. Local compute: measured here with one thread\n"
              "per rank (copies, adds, compression). The latency of each method is fitted on the smallest\n"
              "measured size; every other measured point is then predicted and printed beside the\n"
              "measurement. Predictions for larger clusters use --predict-alpha as the latency.",
              "JSON: schema lbcomm-bench/model with alpha_s (fitted latencies per rank count and method), "
              "checks (measured against predicted), grid (the predictions) and measured (the allreduce "
              "documents used).")
    _add_common(md, None)
    md.add_argument("--bandwidth", type=_rate, default="1gbit",
                    help="link rate of the emulated cluster for the measured points (default: 1gbit; needs root)")
    md.add_argument("--world-sizes", type=_comma(_int_at_least(2)), default=[2, 4],
                    help="rank counts to measure (default: 2,4)")
    md.add_argument("--sizes", type=_sizes, default=_sizes("4K,1M,8M"),
                    help="sizes to measure; the smallest calibrates the latency (default: 4K,1M,8M)")
    md.add_argument("--iters", type=_positive, default=10, help="timed iterations (default: 10)")
    md.add_argument("--warmup", type=_int_at_least(0), default=2, help="untimed iterations (default: 2)")
    md.add_argument("--block-size", type=_block_size, default=2048,
                    help="onebit: elements per scale, a multiple of 32, or 'none' (default: 2048)")
    md.add_argument("--pieces", type=_positive, default=1,
                    help="onebit pieces of the measured runs (default: 1; the model is of the unpipelined call)")
    md.add_argument("--from-json", nargs="+", metavar="FILE",
                    help="use these `lbcomm-bench allreduce --json` results instead of measuring")
    md.add_argument("--predict-alpha", type=_seconds, default=50e-6,
                    help="latency per message of the predicted clusters: seconds or a time like 50us "
                         "(default: 50us)")
    md.add_argument("--predict-size", type=lambda s: _sizes(s)[0], default=8 * 2**20,
                    help="size of the predictions (default: 8M elements = 32 MiB)")
    md.add_argument("--predict-world-sizes", type=_comma(_int_at_least(2)), default=[2, 4, 8, 16, 32, 64, 128, 256],
                    help="rank counts of the predictions (default: 2,4,...,256)")
    md.add_argument("--predict-bandwidths", type=_comma(_rate), default=["1gbit", "10gbit", "25gbit", "100gbit"],
                    help="link rates of the predictions (default: 1gbit,10gbit,25gbit,100gbit)")
    md.set_defaults(command="model", methods=["fp32", "onebit"])


def _add_model_nodes(sub) -> None:
    mn = _sub(sub, "model-nodes", "cost model of N nodes x G ranks: flat, hierarchical and HSDP, calibrated on "
              "emulated nodes",
              "The cost model of one gradient reduction on N nodes x G ranks per node, with the link between\n"
              "nodes and the link inside a node separately (lbcomm/cli/nodemodel.py): fp32 ring, flat 1-bit,\n"
              "hierarchical 1-bit (fp32 inside a node), and HSDP's reduction in fp32, bf16 and 1 bit across\n"
              "nodes. Calibration: the allreduce benchmark on emulated nodes (--nodes x --ranks-per-node,\n"
              "links shaped to --bandwidth; or --from-json); per method, the latency per message and the\n"
              "local compute per element (kernels and shared-memory stages on this machine's cores) are\n"
              "fitted on the two smallest sizes, every larger size is predicted beside its measurement. Then a\n"
              "PREDICTION for GPU clusters: --predict-ranks-per-node GPUs per node, kernel times estimated\n"
              "from memory traffic over --mem-bandwidth (H100: about 3 TB/s), NVLink as the intra-node link.",
              "JSON: schema lbcomm-bench/model-nodes with calibration (links fitted), checks (measured against "
              "predicted), assumptions and grid (the predictions, seconds per reduction by method).")
    _add_common(mn, None)
    mn.add_argument("--nodes", type=_int_at_least(2), default=2, help="emulated nodes to measure (default: 2)")
    mn.add_argument("--ranks-per-node", type=_int_at_least(2), default=2,
                    help="ranks per emulated node (default: 2)")
    mn.add_argument("--bandwidth", type=_rate, default="1gbit",
                    help="link rate between the emulated nodes (default: 1gbit; needs root)")
    mn.add_argument("--sizes", type=_sizes, default=_sizes("1M,8M,32M"),
                    help="sizes to measure, at least 3: the two smallest calibrate, the others check "
                         "(default: 1M,8M,32M)")
    mn.add_argument("--iters", type=_positive, default=6, help="timed iterations (default: 6)")
    mn.add_argument("--warmup", type=_int_at_least(0), default=2, help="untimed iterations (default: 2)")
    mn.add_argument("--block-size", type=_block_size, default=2048,
                    help="onebit: elements per scale, a multiple of 32, or 'none' (default: 2048)")
    mn.add_argument("--from-json", metavar="FILE",
                    help="an `lbcomm-bench allreduce --nodes N --ranks-per-node G --bandwidth B --methods "
                         "fp32,onebit,hier --json` result instead of measuring")
    mn.add_argument("--predict-ranks-per-node", type=_int_at_least(1), default=8,
                    help="GPUs per node of the predictions (default: 8)")
    mn.add_argument("--predict-nodes", type=_comma(_int_at_least(2)), default=[4, 8, 16, 32, 64, 128],
                    help="node counts of the predictions (default: 4,8,16,32,64,128)")
    mn.add_argument("--predict-bandwidths", type=_comma(_rate), default=["25gbit", "100gbit", "400gbit"],
                    help="link rates between nodes, per node and direction (default: 25gbit,100gbit,400gbit)")
    mn.add_argument("--predict-params", type=_comma(_typed(parse_params)), default=[350_000_000, 1_300_000_000,
                                                                                  7_000_000_000],
                    help="model sizes (gradient elements) of the predictions (default: 350M,1.3B,7B)")
    mn.add_argument("--mem-bandwidth", type=_bytes_per_s, default=3e12,
                    help="GPU memory bandwidth in bytes/s for the kernel estimates (default: 3TB = H100 SXM)")
    mn.add_argument("--intra-bandwidth", type=_bytes_per_s, default=360e9,
                    help="bytes/s per GPU and direction inside a node (default: 360GB, NVLink 4 as NCCL reaches "
                         "it)")
    mn.add_argument("--predict-alpha", type=_seconds, default=20e-6,
                    help="latency per message between nodes (default: 20us)")
    mn.add_argument("--predict-intra-alpha", type=_seconds, default=5e-6,
                    help="latency per message inside a node (default: 5us)")
    mn.set_defaults(command="model-nodes", methods=["fp32", "onebit", "hier"])


def _core_share(text: str) -> float:
    v = _float_over(0, "share of a core")(text)
    if v > 1:
        raise argparse.ArgumentTypeError(f"must be at most 1 (the one-thread timing does not scale up), got {text!r}")
    return v


def _add_advise(sub) -> None:
    ad = _sub(sub, "advise", "will 1-bit help my run? predicted step times for a model and a cluster",
              "Predict the training-step time of data-parallel training with fp32 and fp16 allreduce, PowerSGD,\n"
              "and 1-bit Adam/LAMB (warmup and compression stage), from your model's parameter count, your\n"
              "cluster (nodes, ranks per node, link rate and latency) and your compute time per step\n"
              "(forward + backward + optimizer, measured without communication, e.g. on one rank).\n\n"
              "One step = compute + communication, not overlapped. Communication = latency per message x\n"
              "messages + bytes a node sends / link rate + the local compute of the method (casts, adds,\n"
              "compression: timed on this machine with one thread, scaled linearly from at most 4M\n"
              "elements). A ring allreduce sends through each node's link what one rank sends; the 1-bit\n"
              "all-to-all and all-gather send what the node's ranks send to other nodes. Communication\n"
              "inside a node is taken as free unless --intra-bandwidth is given; where CPU ranks share cores,\n"
              "--cores-per-rank slows their compute. On several nodes of several\n"
              "ranks, onebit_hier is the hierarchical 1-bit call (fp32 inside a node, 1 bit between\n"
              "nodes), and the verdict says whether it or the flat call is faster. PowerSGD counts every\n"
              "parameter in --width x --width\n"
              "matrices. The verdict says plainly when compression will not pay.",
              "JSON: schema lbcomm-bench/advise with inputs, verdict and rows; one row per method:\n"
              + describe_fields(ADVISE_ROW_FIELDS))
    ad.add_argument("--params", type=_typed(parse_params), required=True,
                    help="parameters of the model: 125M, 1.3B (K, M, B = powers of 1000)")
    ad.add_argument("--nodes", type=_positive, required=True, help="machines, one network link each")
    ad.add_argument("--ranks-per-node", type=_positive, default=1, help="ranks (GPUs) per machine (default: 1)")
    ad.add_argument("--bandwidth", type=_rate, required=True,
                    help="link rate of each machine per direction: 1gbit, 10gbit, 100gbit")
    ad.add_argument("--latency", type=_seconds, default=50e-6,
                    help="latency per message between machines: seconds or a time like 50us (default: 50us)")
    ad.add_argument("--intra-bandwidth", type=_rate, default=None,
                    help="link rate between the ranks of a machine (NVLink 3600gbit, PCIe 200gbit), used by the "
                         "hierarchical 1-bit call's fp32 stages (onebit_hier, with --ranks-per-node > 1) "
                         "(default: free)")
    ad.add_argument("--cores-per-rank", type=_core_share, default=1.0,
                    help="CPU ranks: the share of a core each rank computes on, below 1 when the ranks of a "
                         "machine share its cores (0.5: 4 ranks on 2 cores); the local compute timed on one "
                         "core is divided by it (default: 1)")
    ad.add_argument("--step-time", type=_seconds, required=True,
                    help="compute time of one training step without communication: 400ms, 1.2s")
    ad.add_argument("--block-size", type=_block_size, default=2048,
                    help="1-bit: elements per scale, a multiple of 32, or 'none' (default: 2048)")
    ad.add_argument("--powersgd-rank", type=_positive, default=4, help="PowerSGD's rank (default: 4)")
    ad.add_argument("--width", type=_int_at_least(2), default=1024,
                    help="PowerSGD: side of the square matrices the parameters are counted in (default: 1024)")
    ad.add_argument("--bucket-size", type=_typed(parse_size), default=25 * 2**20,
                    help="DDP's gradient bucket, one allreduce each: 25mb (default: 25mb = 25 MiB)")
    ad.add_argument("--device", choices=("cpu", "cuda"), default="cpu",
                    help="where to time the local compute of each method (default: cpu)")
    ad.add_argument("--json", metavar="FILE", help="write the prediction as JSON (fields listed below)")
    ad.set_defaults(command="advise")


def build_parser() -> argparse.ArgumentParser:
    """The whole parser: one function per command (race's in racecli.py), in the order of the help."""
    from .racecli import add_parser as add_race

    parser = argparse.ArgumentParser(prog="lbcomm-bench", description=DESCRIPTION,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", metavar="{allreduce,train,model,model-nodes,advise,race}")
    sub.required = True
    for add in (_add_allreduce, _add_train, _add_model, _add_model_nodes, _add_advise):
        add(sub)
    add_race(sub, _sub)
    for p in sub.choices.values():  # placeholders in words (WORLD-SIZE), not Python names (WORLD_SIZE)
        for action in p._actions:
            if action.option_strings and action.metavar is None and action.nargs != 0 and not action.choices:
                action.metavar = action.dest.upper().replace("_", "-")
    return parser
