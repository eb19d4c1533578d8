"""A toy RL training loop on a fleetwarden fleet: rollouts, sleep, train, wake, refit.

Each step generates ``--rollouts`` chat completions through the router with the official
``openai`` client (retrying a 500 at most 3 times, as NeMo-Gym does; a 409 fails the row),
each demanding the current weights (``x-fleetwarden-min-weight-version``) and checked against
the version its answer names (``x-fleetwarden-weight-version``). Then, as colocated RL does,
the engines are put to sleep for the training step (``FleetClient.sleep()``: out of routing,
then vLLM's ``/sleep``) and woken after it (``wake()``); then "new weights" are pushed with a
refit to version + 1: begin (the participants to push to), the push (here: the version stamped
on each engine, as vLLM's ``finish_weight_update {"weight_version"}`` ends a real push; the
completion credits only engines that say they hold it), complete. (A trainer that writes
checkpoints to disk can have fleetwarden run the whole sync: ``FleetClient.refit_from``,
``examples/refit_from_loop.py``.)

With ``--hang-refit-at-step K`` one participant wedges during step K's weight push (its API
stops answering, as an engine stuck in a broadcast). The trainer polls
``FleetClient.refit_status()``, sees the culprit named within seconds, aborts the refit naming
it (the abort condemns it: the single suspect), and pushes again to the others; the replacement
waits in STALE for the next refit.

With ``--kill-at-step K`` it crashes one engine in the middle of step K's rollouts. The loop
must finish every step: the router re-sends what the dead engine held, the supervisor starts
a replacement, which waits in STALE (its weights are the checkpoint's) until the next refit.

    python examples/rl_loop.py --steps 6 --kill-at-step 2          # starts its own fleet
    python examples/rl_loop.py --steps 6 --hang-refit-at-step 3
    python examples/rl_loop.py --admin http://127.0.0.1:8081 --token-file fleetwarden-admin.token \\
                               --router http://127.0.0.1:8080     # or uses a running one

Exit status 0 when every rollout of every step succeeded on the weights it demanded.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import openai

from fleetwarden.client import FleetClient
from fleetwarden.testing.up import UpProcess

#: The NeMo-Gym rule: a 500 is re-sent a bounded number of times; anything else fails the row.
CLIENT_RETRIES_ON_500 = 3


#: How long the trainer waits for fleetwarden to name a participant of a hung refit.
NAME_WITHIN_S = 15.0


async def rollout(client: openai.AsyncOpenAI, step: int, n: int,
                  version: int) -> tuple[bool, int, int | None]:
    """One rollout on weights of at least ``version``; returns (succeeded, client re-sends,
    the version its answer names)."""
    resent = 0
    while True:
        try:
            raw = await client.chat.completions.with_raw_response.create(
                model="tiny", max_tokens=16,
                messages=[{"role": "user", "content": f"step {step} rollout {n}"}],
                extra_headers={"x-request-id": f"rollout-{step}-{n}",
                               "x-fleetwarden-min-weight-version": str(version)})
            named = raw.headers.get("x-fleetwarden-weight-version")
            return True, resent, None if named is None else int(named)
        except openai.APIStatusError as exc:
            if exc.status_code == 500 and resent < CLIENT_RETRIES_ON_500:
                resent += 1
                continue
            return False, resent, None
        except openai.APIError:
            return False, resent, None


def push_weights(lease: dict[str, Any], version: int) -> None:
    """The weight push, as far as simulated engines take one: each participant's engine is
    told the version it now holds (vLLM: ``POST /update_weight_version``, or the
    ``weight_version`` of ``/finish_weight_update``). One that does not answer is left to the
    completion, which does not credit it."""
    for p in lease["participants"]:
        req = urllib.request.Request(
            p["url"] + "/update_weight_version", method="POST",
            data=json.dumps({"new_version": str(version)}).encode(),
            headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=5):
                pass
        except OSError:
            continue


async def hang_and_abort(fleet: FleetClient, version: int, lease: dict[str, Any]) -> None:
    """One participant wedges in the weight push; fleetwarden names it; the trainer aborts."""
    victim = lease["participants"][-1]["shard"]
    hung_at = time.monotonic()
    await asyncio.to_thread(fleet.chaos, victim, "refuse")  # its API stops answering
    print(f"      -- shard {victim} wedged in the refit to v{version} --")
    while True:
        status = await asyncio.to_thread(fleet.refit_status)
        if status and status["culprits"]:
            break
        if time.monotonic() - hung_at > NAME_WITHIN_S:
            raise SystemExit(f"no culprit named within {NAME_WITHIN_S:g} s")
        await asyncio.sleep(0.2)
    row = next(p for p in status["status"] if p["culprit"])
    print(f"      -- fleetwarden named shard {row['shard']} after "
          f"{time.monotonic() - hung_at:.1f} s: process alive {row['process_alive']}, "
          f"API answers {row['api_answers']} ({row['evidence'][:60]}) --")
    aborted = await asyncio.to_thread(fleet.abort_refit, version,
                                      f"weight broadcast hung on shard {row['shard']}")
    print(f"      -- aborted; condemned {aborted['condemned']}; pushing again --")


async def run(args: argparse.Namespace, router: str, fleet: FleetClient) -> bool:
    client = openai.AsyncOpenAI(base_url=router + "/v1", api_key="none", max_retries=0,
                                timeout=120)
    version = fleet.refits()["current_version"]
    all_ok = True
    print(f"{'step':>4}  {'rollouts ok':>11}  {'re-sent':>7}  {'versions':>8}  "
          f"{'slept':>5}  {'refit':>10}  shards")
    try:
        for step in range(1, args.steps + 1):
            tasks = [asyncio.create_task(rollout(client, step, n, version))
                     for n in range(args.rollouts)]
            if step == args.kill_at_step:
                await asyncio.sleep(0.2)  # let the rollouts spread over the engines first
                victim = next(s["index"] for s in fleet.shards() if s["state"] == "HEALTHY")
                await asyncio.to_thread(fleet.chaos, victim, "crash")
                print(f"      -- crashed shard {victim}'s engine mid-step --")
            results = await asyncio.gather(*tasks)
            ok = sum(1 for good, _, _ in results if good)
            resent = sum(r for _, r, _ in results)
            # Every answer names the weights that produced it: all must be this step's
            wrong = sum(1 for good, _, named in results if good and named != version)
            all_ok &= ok == args.rollouts and wrong == 0

            slept = 0
            if not args.no_sleep:  # the GPU to the trainer for the training step
                asleep = await asyncio.to_thread(fleet.sleep, 1)
                slept = sum(1 for s in asleep["shards"] if s["state"] == "SLEEPING")
                await asyncio.sleep(args.train_s)  # a real trainer trains here
                await asyncio.to_thread(fleet.wake)

            version += 1
            lease = await asyncio.to_thread(fleet.begin_refit, version)
            await asyncio.sleep(args.push_s)  # a real trainer broadcasts weights here
            if step == args.hang_refit_at_step:
                await hang_and_abort(fleet, version, lease)
                lease = await asyncio.to_thread(fleet.begin_refit, version)
                await asyncio.sleep(args.push_s)
            await asyncio.to_thread(push_weights, lease, version)
            done = await asyncio.to_thread(fleet.complete_refit, version)
            states = Counter(done["states"].values())
            per_shard = " ".join(f"{i}:{s[:4]}" for i, s in sorted(done["states"].items()))
            print(f"{step:>4}  {ok:>5}/{args.rollouts:<5}  {resent:>7}  "
                  f"{'v' + str(version - 1) if not wrong else str(wrong) + ' off':>8}  "
                  f"{slept:>5}  v{version} ({len(lease['participants'])})  "
                  f"{dict(sorted(states.items()))}  [{per_shard}]", flush=True)
    finally:
        await client.close()
    return all_ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--rollouts", type=int, default=16, help="rollouts per step")
    p.add_argument("--kill-at-step", type=int, default=None)
    p.add_argument("--hang-refit-at-step", type=int, default=None,
                   help="a participant wedges in this step's refit: named, aborted, replaced")
    p.add_argument("--no-sleep", action="store_true",
                   help="no sleep/wake bracket around the training step")
    p.add_argument("--train-s", type=float, default=0.3, help="the toy training step's pause")
    p.add_argument("--engines", type=int, default=3, help="engines of the fleet it starts")
    p.add_argument("--push-s", type=float, default=0.3, help="the toy weight push's pause")
    p.add_argument("--admin", help="a running fleet's admin URL (else one is started)")
    p.add_argument("--token-file", default="fleetwarden-admin.token")
    p.add_argument("--router", help="that fleet's router URL")
    args = p.parse_args()

    up = None
    tmp = None
    if args.admin:
        if not args.router:
            raise SystemExit("--router is needed with --admin")
        router, fleet = args.router, FleetClient(args.admin, token_file=args.token_file)
    else:
        tmp = tempfile.TemporaryDirectory(prefix="rl-loop-")
        up = UpProcess(Path(tmp.name), "--weights", "trainer", "--engines", str(args.engines),
                       "--engine-cmd", "{python} -m fleetwarden sim --host {host} --port {port} "
                       "--steps-per-s 40")
        router, fleet = up.router, up.client
        print(f"started a fleet: router {router}, admin {up.admin}")
    try:
        ok = asyncio.run(run(args, router, fleet))
    finally:
        if up is not None:
            up.stop()
        if tmp is not None:
            tmp.cleanup()
    print("every step finished, every rollout succeeded" if ok else "some rollouts FAILED")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
