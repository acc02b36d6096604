"""The text `jshard plan` prints: an estimate (`estimate.estimate`'s dict) as its report, the
model and layout, memory per device by kind, each collective, compute, overlap and the
predicted step.
"""

from __future__ import annotations

from jshard.placement import format_bytes


def report(est: dict) -> str:
    mem, model, moe = est["memory_bytes_per_device"], est["model"], est["moe"]
    hw = est["hardware"]
    mesh = " ".join(f"{a}={n}" for a, n in est["mesh"].items())
    lines = [
        f"jshard plan: {model['kind']} {model['layers']} layers, embed {model['embed']}, heads {model['heads']}"
        + (f" ({model['kv_heads']} kv)" if "kv_heads" in model else "") + f", mlp {model['mlp']}, "
        f"vocab {model['vocab']}" + (f" (table padded to {model['vocab_rows']})" if model["vocab_rows"] != model["vocab"] else "")
        + f", seq {model['seq_len']}: {model['params'] / 1e9:.3g} B params"
        + (f" ({moe['active_params'] / 1e9:.3g} B active)" if moe else "") + f", {model['dtype']}, remat {model['remat']}, "
        f"attention {est['attention']}",
        f"  mesh        {mesh} on {hw['name']} ({hw['gpus_per_node']} per node)",
        f"  precision   {est['precision']}",
        f"  strategy    {est['strategy']}" + (f", {est['schedule']} m={est['microbatches']}, stage remat "
                                              f"{est['stage_remat']}" if est["schedule"] else "")
        + f", micro-batch {est['micro_batch_size']} rows, {est['tokens_per_step']} tokens per step",
    ]
    if moe:
        where = (f"over {moe['expert_axes']}: {moe['experts_per_device']} per device" if moe["expert_axes"]
                 else "no expert axis: every device runs all of them")
        factor = "dropless" if moe["capacity_factor"] is None else f"factor {moe['capacity_factor']:g}"
        every = "every block" if moe["moe_every"] == 1 else f"{moe['moe_layers']} of the {model['layers']} blocks"
        lines.append(f"  experts     {moe['experts']} in {every}, top-{moe['top_k']}, capacity {moe['capacity']} slots per "
                     f"expert per row ({factor}): {moe['slots_per_token']:.3g} slots per token run for {moe['top_k']} "
                     f"routed (the experts' FLOPs ×{moe['slots_per_token'] / moe['top_k']:.3g}); {where} "
                     f"({format_bytes(moe['expert_param_bytes_per_device'], 2)} of expert params)")
    lines.append("memory per device")
    for key in ("params", "grads", "master", "optimizer", "accumulated", "gathered", "chunk_weights", "activations",
                "reduction", "batch"):
        if mem.get(key):
            lines.append(f"  {key:<14}{format_bytes(mem[key], 2):>12}")
        if key == "optimizer":
            lines.append(f"  {'(model state)':<14}{format_bytes(est['model_state_bytes'], 2):>12}  = params + grads + master + optimizer")
    lines.append(f"  {'total':<14}{format_bytes(mem['total'], 2):>12}  of {format_bytes(hw['hbm_bytes'], 2)} HBM"
                 + ("" if est["fits"] else "  DOES NOT FIT"))
    if est["stage_remat_trade"]:
        lines.append("  stage remat  " + ";  ".join(
            f"{mode}: activations {format_bytes(t['activations'], 2)}, pipeline work ×{t['work']:.2f}"
            for mode, t in est["stage_remat_trade"].items()) + "  (--stage-remat)")
    lines.append("communication per step (K bytes per device in its calls; time: each call's latency + bytes at the link's bandwidth)")
    for r in est["collectives"]:
        lines.append(f"  {r['kind']:<19}{r['axes']:<12}×{r['group']:<4}{format_bytes(r['bytes'], 2):>12}{r['calls']:>6} calls  "
                     f"{r['link']:<6}{r['seconds'] * 1e3:10.3f} ms")
    ratios = "  ".join(f"{k} {v:.3f}" for k, v in est["overlap_ratios"].items() if v is not None) or "none"
    lines += [
        f"  compute     {est['compute_s'] * 1e3:.3f} ms: "
        + ", ".join(f"{name.replace('_', '-')} {t * 1e3:.3f}" for name, t in est["compute_terms"].items() if t)
        + (f" ({est['flops_per_step']['run'] / est['flops_per_step']['model']:.3f}× the model FLOPs MFU counts)"
           if moe else ""),
        f"  overlap     t_comm/t_compute: {ratios}",
        f"  bubble      {est['bubble_fraction']:.3f}",
        f"  predicted   step {est['predicted_step_s'] * 1e3:.3f} ms, MFU {est['predicted_mfu'] * 100:.1f}%",
    ]
    lines += [f"warning: {w}" for w in est["warnings"]]
    return "\n".join(lines)
