"""The coordinator for examples/swarm_worker.py: master weights, Adam, held-out evaluation.

Run: SWARMTRAIN_SECRET=... python examples/swarm_coordinator.py --min-workers 2 --max-steps 1500
then start examples/swarm_worker.py on each machine. The model, the data and the metric are
imported from the worker script, so both sides build the same model.
"""

import argparse
import asyncio
import logging
import os
import signal

import torch
from swarm_worker import accuracy, build_model, make_spiral

from swarmtrain import Coordinator


async def serve(args: argparse.Namespace) -> None:
    torch.manual_seed(0)
    model = build_model()
    x_test, y_test = make_spiral(1000, seed=1)  # the same held-out set as the worker's
    print(f"untrained held-out accuracy {accuracy(model, x_test, y_test):.3f}", flush=True)
    coordinator = Coordinator(
        model, host=args.host, port=args.port, min_workers=args.min_workers, max_steps=args.max_steps,
        learning_rate=3e-3, eval_interval_sec=2.0,
        evaluate=lambda m: {"accuracy": accuracy(m, x_test, y_test)},
    )  # the secret comes from $SWARMTRAIN_SECRET
    await coordinator.start()
    print(f"listening on {args.host}:{coordinator.port}", flush=True)
    if args.port_file:  # written atomically, for scripts that start it with --port 0
        with open(args.port_file + ".tmp", "w") as f:
            f.write(str(coordinator.port))
        os.replace(args.port_file + ".tmp", args.port_file)
    for sig in (signal.SIGINT, signal.SIGTERM):  # Ctrl-C: checkpoint, tell the workers, stop
        asyncio.get_running_loop().add_signal_handler(sig, coordinator.request_shutdown, "interrupted")
    await coordinator.run()  # until max_steps updates have been applied (or Ctrl-C)
    final = coordinator.metrics.get("accuracy", float("nan"))
    print(f"final held-out accuracy {final:.3f} after {coordinator.version} updates", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--host", default="0.0.0.0", help="address to listen on")
    parser.add_argument("--port", type=int, default=7100, help="0 = any free port")
    parser.add_argument("--port-file", help="write the port here once listening")
    parser.add_argument("--min-workers", type=int, default=1, help="workers to wait for before starting")
    parser.add_argument("--max-steps", type=int, default=1500, help="updates to apply, then stop")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    asyncio.run(serve(args))


if __name__ == "__main__":
    main()
