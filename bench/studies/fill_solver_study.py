"""Study: does a better coarse fill of region M let edits resume deeper?

    nice -n 5 .venv/bin/python bench/studies/fill_solver_study.py   # ~7 min, --per 6 pairs per kind

Other-evidence hits (edits, other scenes on the same noise) resume at k* ≈ 10 of 20 because
region M is filled by the request's own trajectory from the probe to k* in two coarse
steps of the user's sampler (euler here). This measures, on pairs of the calibration
workload (variant reusing anchor, every stored depth, finished every step), how many
reuses miss tolerance with that fill against a multistep solver (ComfyUI's dpmpp_2m, one
model call per step, uses the previous step's x̂0) and against three coarse steps.
Writes bench/results/studies/fill_solver.json.
"""
import argparse, json, os, sys, random, time, collections
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path[:0] = [REPO + "/tests", REPO]
sys.path.append(REPO + "/bench")  # last: bench/tinyworld.py is no package
import calibrate as C


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description="Does a better coarse fill of region M let edits resume deeper?")
    ap.add_argument("--per", type=int, default=int(os.environ.get("PER", 6)), help="pairs per kind")
    per = ap.parse_args(argv).per
    C._load_bench()
    from bench_tw import World, DEFAULT_MODEL, check_ok, load_workload, psnr
    from carnator_core.gate import GateSettings, RiskModel, evidence_class
    from carnator_core.pipeline import ReuseSettings
    from carnator_core.calibration import fit as CAL
    world = World(DEFAULT_MODEL, steps=20, cfg=4.0, threads=1)
    from carnator_core import comfy_adapter as CA
    from carnator_core.calibration.generic import measure_direction
    _, L = load_workload("calibration")
    groups = collections.defaultdict(list)
    for l in L: groups[l["group"]].append(l)
    kinds = ["partial", "edit_chain", "session_chain", "incompatible_close"]
    rng = random.Random(7)
    pick = []
    for kd in kinds:
        gs = [g for g, m in groups.items() if m[0]["kind"] == kd]
        pick += rng.sample(gs, per)
    orig_jump = CA.ComfyRun.jump
    def make_jump(sampler):
        def jump(self, start, end, boundary_latent, calls):
            saved = self.sampler_name; self.sampler_name = sampler
            try: return orig_jump(self, start, end, boundary_latent, calls)
            finally: self.sampler_name = saved
        return jump
    variants = [("euler", 2), ("dpmpp_2m", 2), ("euler", 3), ("dpmpp_2m", 3)]
    res = collections.defaultdict(lambda: collections.defaultdict(list))
    t0 = time.time()
    snaps_all = None
    for g in pick:
        a_l, b_l = groups[g][1], groups[g][0]  # variant reuses anchor
        settings = ReuseSettings(probe_fraction=0.1, gate=GateSettings())
        p = settings.probe_steps(20); snaps = settings.snapshot_steps(20)
        fa = world.full(a_l["prompt"], int(a_l["seed"]), "same_seed", snaps, p); fa["ok"] = check_ok(fa["video"], a_l["scene"])
        fb = world.full(b_l["prompt"], int(b_l["seed"]), "same_seed", snaps, p)
        for sampler, calls in variants:
            CA.ComfyRun.jump = make_jump(sampler)
            settings.region_fill_calls = calls
            def outcome(final):
                v = world.video(final); q = psnr(v, fa["video"]); ok = check_ok(v, a_l["scene"])
                return {"psnr": q, "ok": ok, "label": CAL.exceeds_tolerance(q, fa["ok"], ok, 30.0)}
            inst = measure_direction(fa["full"], fb["full"], lambda: world.new_run(a_l["prompt"], int(a_l["seed"]), "same_seed"),
                                     settings, RiskModel().region_threshold, outcome)
            for d in inst["depths"]:
                if not d.get("finish_calls"):
                    res[f"{sampler}-{calls}"][d["k"]].append((d["label"], d["psnr"], groups[g][0]["kind"]))
        CA.ComfyRun.jump = orig_jump
        print(f"{len(res['euler-2'][10])} pairs, {time.time()-t0:.0f}s", flush=True)
    summary = {v: {k: {"pairs": len(x), "beyond": sum(l for l, _, _ in x), "mean_psnr": round(sum(q for _, q, _ in x)/len(x), 2)}
                   for k, x in sorted(ks.items())} for v, ks in res.items()}
    print(json.dumps(summary, indent=1))
    json.dump({"summary": summary, "groups": pick, "kinds": kinds, "psnr_bound": 30.0, "steps": 20},
              open(f"{REPO}/bench/results/studies/fill_solver.json", "w"), indent=1)


if __name__ == "__main__":
    main()
