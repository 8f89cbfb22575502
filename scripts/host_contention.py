"""Does the engine's step slow down when other processes use the host's CPU (as a server's front end
and its clients do)? The serving burst of docs/serving.md (random Llama-3.2-1B, 256 slots, 512
requests, prompts 64-512 tokens, 32-256 new tokens) through LLM.generate, pass after pass in ONE
process, the arms interleaved:

    alone         nothing else running
    burnN         N processes spinning in Python loops meanwhile
    gil           a thread of this process waking every 2 ms to pickle a message through a pipe
                  (what the core process's writer thread does once a step)
    pin           this process on CPUs 0-3 (burners, if any, on the others)
    t1            torch.set_num_threads(1) for the pass
    (combined with _, e.g. t1_burn8, pin_burn3)

    python scripts/host_contention.py alone,burn3,burn8,gil,pin,pin_burn3 4     # arms, rounds

Per pass: tokens/s, TTFT p99, prompt and decode-only steps, the host's phases per step; medians per
arm at the end, all passes in $OUT/contend.json. MODEL / NP / IL (env) shrink it for a CPU check.
Session 15's runs on the H200 host (16 cores): docs/serving.md, docs/host_contention_s15.json."""
import json, multiprocessing as mp, os, pickle, shlex, statistics, sys, threading, time
from pagedlab.bench.serve import build_parser, make_workload, step_kinds, host_per_step
from pagedlab.__main__ import build_objects, build_parser as cli_parser
from pagedlab.llm import LLM
from pagedlab.sampling import SamplingParams

def burn(stop):
    x = 0
    while not stop.is_set():
        for _ in range(10000):
            x += 1

def main():
    args = build_parser().parse_args(("--input-len " + os.environ.get("IL", "288") + " --output-len 144 --range-ratio 0.78 --ignore-eos --num-prompts " + os.environ.get("NP", "512")).split())
    jobs = make_workload(args)
    a = cli_parser().parse_args(["serve", *shlex.split("--model " + os.environ.get("MODEL", "random:llama-3.2-1b") + " --slots 256 --max-model-len 2048 --no-prefix-caching")])
    build_objects(a, sampling=False)
    llm = LLM(a.model, **a.engine_kwargs)
    prompts = [j.prompt for j in jobs]
    params = [SamplingParams(max_tokens=j.output_len, temperature=0.0, ignore_eos=True) for j in jobs]
    llm.generate(prompts[:16], params[:16]); llm.generate(prompts, params)
    core = llm.core
    ncpu = os.cpu_count(); allc = set(range(ncpu))
    print("cpus", ncpu, "affinity", sorted(os.sched_getaffinity(0)), "torch threads", __import__("torch").get_num_threads(), flush=True)
    ctx = mp.get_context("spawn")
    res = {}
    def one(arm):
        stop = ctx.Event(); procs = []; th = None; flag = [True]
        nb = int(arm.split("burn")[1].split("_")[0]) if "burn" in arm else 0
        for i in range(nb):
            p = ctx.Process(target=burn, args=(stop,), daemon=True); p.start(); procs.append(p)
            if "pin" in arm:
                os.sched_setaffinity(p.pid, allc - {0, 1, 2, 3})
        if "pin" in arm:
            os.sched_setaffinity(0, {0, 1, 2, 3})
        if "gil" in arm:
            r, w = mp.Pipe(duplex=False)
            payload = list(range(144 * 3))
            def writer():
                while flag[0]:
                    time.sleep(0.002); w.send(payload); r.recv()
            th = threading.Thread(target=writer, daemon=True); th.start()
        import torch
        nt = torch.get_num_threads()
        if arm.startswith("t1"):
            torch.set_num_threads(1)
        time.sleep(0.3)
        b = (core.num_steps, core.step_seconds, core.prompt_steps, core.prompt_step_seconds, dict(core.engine.timing))
        t0 = time.perf_counter(); outs = llm.generate(prompts, params); dt = time.perf_counter() - t0
        af = (core.num_steps, core.step_seconds, core.prompt_steps, core.prompt_step_seconds, dict(core.engine.timing))
        flag[0] = False; stop.set()
        for p in procs: p.join(5)
        if th: th.join(2)
        os.sched_setaffinity(0, allc)
        torch.set_num_threads(nt)
        tok = sum(len(o.token_ids) for o in outs)
        k = step_kinds(*(x - y for x, y in zip(af[:4], b[:4]))) | host_per_step(af[0] - b[0], {kk: v - b[4][kk] for kk, v in af[4].items() if kk != "steps"})
        ttft = sorted(o.ttft_s for o in outs)[int(0.99 * len(outs))] * 1e3
        res.setdefault(arm, []).append({"tok_s": tok / dt, "ttft_p99_ms": ttft} | k)
        h = k.get("host_ms_per_step", {})
        print(f"{arm:14s} {tok/dt:8.0f} tok/s ttft p99 {ttft:6.0f}  prompt {k['prompt_steps']}x{k['prompt_step_ms']:.1f}ms decode {k['decode_steps']}x{k['decode_step_ms']:.2f}ms  " + " ".join(f"{q} {v:.2f}" for q, v in h.items()), flush=True)
    arms = sys.argv[1].split(",")
    for rep in range(int(sys.argv[2])):
        for arm in arms:
            one(arm)
    print("MEDIANS")
    for arm, rows in res.items():
        print(f"{arm:14s} tok/s {statistics.median(r['tok_s'] for r in rows):8.0f}  decode ms {statistics.median(r['decode_step_ms'] for r in rows):.3f} prompt ms {statistics.median(r['prompt_step_ms'] for r in rows):.2f} ttft p99 {statistics.median(r['ttft_p99_ms'] for r in rows):.0f}")
    json.dump(res, open(os.path.join(os.environ.get("OUT", "."), "contend.json"), "w"), indent=1)
    llm.close()

if __name__ == "__main__":
    main()
