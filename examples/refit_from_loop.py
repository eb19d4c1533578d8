"""A trainer that writes a checkpoint each step and has fleetwarden load it into the fleet.

Each step: ``--rollouts`` completions through the router (the official ``openai`` client; a
409, which the router answers while every engine loads, is re-sent after a pause), then the
"training step" writes the next checkpoint to disk and ``FleetClient.refit_from(path,
version)`` loads it: the engines out of routing, each paused (the fleet's ``[refit]
pause_mode``), reloaded from the path, stamped with the version, resumed, and credited only
where the engine itself reports the version. The trainer is told per engine whether it took
the weights, whether its engine confirmed them, and the engine's error if not; a failed engine
stays STALE (serving nothing) until a later load succeeds on it.

The engines here are simulated vLLM engines, whose answers depend on the checkpoint file's
bytes, so a rollout's text shows which checkpoint produced it; the loop checks each answer's
``x-fleetwarden-weight-version`` against it. With ``--bad-path-at-step K`` the trainer names a
checkpoint that is not there at step K: every engine refuses it, none is credited, and the
trainer loads the right one again.

    python examples/refit_from_loop.py --steps 5 --bad-path-at-step 2

Exit status 0 when every rollout got an answer whose version names the checkpoint behind it.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
from pathlib import Path

import openai

from fleetwarden.client import FleetClient
from fleetwarden.testing.up import UpProcess

PROMPTS = ("Say something", "Count with me", "What comes next")


async def rollout(client: openai.AsyncOpenAI, prompt: str) -> tuple[str, int]:
    """One rollout's (text, weight version named); a 409 is re-sent after a pause."""
    for _ in range(600):
        try:
            raw = await client.completions.with_raw_response.create(
                model="tiny", prompt=prompt, max_tokens=12, temperature=0)
            return raw.parse().choices[0].text, int(raw.headers["x-fleetwarden-weight-version"])
        except openai.ConflictError:  # no engine serves: a load is under way
            await asyncio.sleep(0.05)
    raise RuntimeError(f"no answer to {prompt!r}")


async def run(args: argparse.Namespace, router: str, fleet: FleetClient, ckpts: Path) -> bool:
    client = openai.AsyncOpenAI(base_url=router + "/v1", api_key="none", max_retries=0)
    texts: dict[int, dict[str, str]] = {}  # what each version answered, per prompt
    ok = True
    print("step  rollouts  version  load  per engine (shard: took/confirmed/state)")
    try:
        for step in range(1, args.steps + 1):
            results = await asyncio.gather(*(rollout(client, PROMPTS[n % len(PROMPTS)])
                                             for n in range(args.rollouts)))
            # One checkpoint, one answer per prompt: a version whose answers disagree was
            # labelled on more than one checkpoint's tokens.
            for n, (text, version) in enumerate(results):
                seen = texts.setdefault(version, {}).setdefault(PROMPTS[n % len(PROMPTS)], text)
                ok &= seen == text
            path = ckpts / f"step-{step}.bin"
            path.write_bytes(f"weights after training step {step}".encode())  # the "training"
            if step == args.bad_path_at_step:
                bad = await asyncio.to_thread(fleet.refit_from, str(ckpts / "missing"), step)
                print(f"      a path that is not there: credited {bad['credited']}, errors: "
                      f"{sorted({e['error'][:60] for e in bad['engines']})}")
            done = await asyncio.to_thread(fleet.refit_from, str(path), step)
            engines = " ".join(f"{e['shard']}:{'y' if e['took'] else 'n'}/"
                               f"{'y' if e['confirmed'] else 'n'}/{e['state'][:4]}"
                               for e in done["engines"])
            named = sorted({v for _, v in results})
            # What faults cost the step (the routers' count since the last load): 0 where none.
            cost = {k: v for k, v in (done.get("cost") or {}).items() if v}
            print(f"{step:>4}  {len(results):>8}  {named!s:>7}  {done['seconds']:.2f}s  "
                  f"{engines}{f'  cost {cost}' if cost else ''}", flush=True)
            ok &= len(done["credited"]) > 0
    finally:
        await client.close()
    return ok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--rollouts", type=int, default=12, help="rollouts per step")
    p.add_argument("--engines", type=int, default=3)
    p.add_argument("--bad-path-at-step", type=int, default=None)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="refit-from-") as tmp:
        up = UpProcess(Path(tmp), "--weights", "trainer", "--engines", str(args.engines),
                       "--engine-cmd", "{python} -m fleetwarden sim --host {host} --port {port} "
                       "--steps-per-s 100")
        print(f"started a fleet: router {up.router}, admin {up.admin}")
        try:
            ckpts = Path(tmp) / "checkpoints"
            ckpts.mkdir()
            ok = asyncio.run(run(args, up.router, up.client, ckpts))
        finally:
            up.stop()
    print("every answer named the checkpoint behind it" if ok else "some answers were WRONG")
    raise SystemExit(0 if ok else 1)


if __name__ == "__main__":
    main()
