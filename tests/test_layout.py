"""One `jshard.Layout`, taken whole by `build_step`, `make_plan`, `aot.compile_step` and the
planner: the same step as the keyword form it replaces, every field checked in one line that
names it, and the command line speaking in flags where the library speaks in fields."""

import re
import warnings

import numpy as np
import optax
import pytest
from flax import nnx

import jshard
from jshard import aot
from jshard import planner
from jshard.cli import flags
from jshard.layout import Layout, LayoutError
from jshard.models import gpt_loss
from jshard.parallel import build_step, make_plan

import decoders

pytestmark = pytest.mark.fast

OPTIMIZER = optax.adamw(1e-3)
BATCH = np.random.default_rng(0).integers(0, 64, (16, decoders.CONFIGS["gpt"].seq_len + 1))

# (a layout's line, the same layout as the keyword form before Layout took: mesh sizes, preset, options)
SAME_STEPS = [
    ("dp+tp data=4,tensor=2 accum=2 precision=mixed", dict(data=4, tensor=2), "dp+tp",
     dict(grad_accum=2, precision="mixed")),
    ("pp+dp stage=2,data=4 m=2 schedule=1f1b stage-remat=full", dict(stage=2, data=4), "pp+dp",
     dict(microbatches=2, schedule="1f1b", stage_remat="full")),
]


def program(step) -> str:
    """The lowered step without its mesh declaration (which names devices)."""
    tokens = step.shard_batch(BATCH)
    return re.sub(r"sdy\.mesh @\w+ = <[^\n]*\n", "", step.lower(step.state, tokens).as_text())


@pytest.mark.parametrize("line, sizes, preset, options", SAME_STEPS, ids=[s[0].split()[0] for s in SAME_STEPS])
def test_a_layout_line_builds_the_step_the_keyword_form_built(line, sizes, preset, options):
    model = lambda: decoders.make("gpt", 0, layers=4)  # noqa: E731
    whole = build_step(model(), OPTIMIZER, gpt_loss, line)  # its mesh from the line, over this host's devices
    mesh = jshard.make_mesh(**sizes)
    with pytest.warns(DeprecationWarning, match=r"build_step\(\.\.\., mesh, rules.*is deprecated: pass one jshard.Layout"):
        old = build_step(model(), OPTIMIZER, gpt_loss, mesh, jshard.preset(preset), **options)
    assert program(whole) == program(old)
    read = ("grad_accum", "microbatches", "stage_remat", "precision", "mesh_sizes")
    assert {f: getattr(whole.plan, f) for f in read} == {f: getattr(old.plan, f) for f in read}


def test_the_planner_takes_the_same_layout():
    """`make_plan` with no mesh plans on the layout's abstract mesh: what `build_step` checks, on no device."""
    layout = Layout.parse(SAME_STEPS[1][0])
    abstract = make_plan(nnx.eval_shape(lambda: decoders.make("gpt", 0, layers=4)), layout)
    built = build_step(decoders.make("gpt", 0, layers=4), OPTIMIZER, gpt_loss, layout).plan
    assert abstract.mesh_sizes == built.mesh_sizes and abstract.stage_layers == built.stage_layers
    assert abstract.schedule == built.schedule and abstract.stage_remat == "full"


def test_the_new_form_has_no_deprecation_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        build_step(decoders.make("gpt", 0), OPTIMIZER, gpt_loss, Layout.of("dp", dict(data=8)),
                   jshard.make_mesh(data=8))


@pytest.mark.parametrize("call, message", [
    (lambda m: build_step(m, OPTIMIZER, gpt_loss, "dp data=8", jshard.make_mesh(data=4, tensor=2)),
     r"^Layout.mesh data=8 is not the mesh given \(data=4,tensor=2\)\. Fix: the same sizes in both"),
    (lambda m: build_step(m, OPTIMIZER, gpt_loss, "dp data=8 remat=full"),
     r"^Layout.remat='full', but the model was built with remat='none'\. Fix: build it from "
     r"dataclasses.replace\(config, remat='full'\)"),
    (lambda m: build_step(m, OPTIMIZER, gpt_loss, "pp+dp stage=2,data=4"),
     r"it needs Layout.microbatches, .* at least 1 \(got None\)\. Fix: Layout.microbatches=4"),
    (lambda m: build_step(m, OPTIMIZER, gpt_loss, "dp data=8 m=4"),
     r"^build_step: Layout.microbatches=4 but rules 'dp' put no layers on a stage axis"),
    (lambda m: build_step(m, OPTIMIZER, gpt_loss, "dp data=8 precision=fp64"),
     r"^Layout.precision='fp64', Layout.reduce=None: precision 'fp64': choose one of"),
    (lambda m: make_plan(m, "dp data=-1"),
     r"^Layout.mesh data=-1: a mesh with no devices needs every size"),
    (lambda m: build_step(m, OPTIMIZER, gpt_loss, 42), r"^layout 42 is a int, not a Layout"),
], ids=["mesh", "remat", "no-microbatches", "microbatches-without-pp", "precision", "abstract -1", "not a layout"])
def test_a_field_no_step_takes_is_one_line_naming_it(call, message):
    with pytest.raises(jshard.ShardingError, match=message):  # (a LayoutError is one)
        call(decoders.make("gpt", 0, layers=2))


def test_a_plain_flax_model_leaves_remat_to_itself():
    class MLP(nnx.Module):
        def __init__(self, rngs):
            self.up = nnx.Linear(4, 4, rngs=rngs)

        def __call__(self, x):
            return self.up(x)

    with pytest.raises(LayoutError, match=r"^Layout.remat='full': this model \(MLP\) has no config.remat"):
        make_plan(MLP(nnx.Rngs(0)), "dp data=8 remat=full")


@pytest.mark.parametrize("fields, message", [
    (dict(grad_accum=0), r"^Layout.grad_accum=0: it counts the micro-batches"),
    (dict(micro_batch_size=True), r"^Layout.micro_batch_size=True: it counts rows per micro-batch"),
    (dict(virtual=-2), r"^Layout.virtual=-2: it counts model chunks per device"),
    (dict(mesh=(("data", 0),)), r"^Layout.mesh: data=0 is not a size"),
])
def test_a_layout_refuses_a_count_that_is_not_one(fields, message):
    with pytest.raises(LayoutError, match=message):
        Layout("dp", **fields)


def test_the_old_options_beside_a_layout_say_where_they_went():
    with pytest.raises(TypeError, match=r"^build_step\(\): microbatches= is a field of the layout\. "
                                        r"Fix: jshard.Layout\(\.\.\., microbatches=\.\.\.\)\."):
        build_step(decoders.make("gpt", 0), OPTIMIZER, gpt_loss, "dp data=8", microbatches=4)


def test_rules_and_a_precision_policy_are_fields_too():
    rules = jshard.preset("dp+tp").add(params=[("embed", None)])
    policy = jshard.precision.precision("mixed", "bf16")
    layout = Layout.of(rules, dict(data=4, tensor=2), precision=policy)
    assert layout.rules is rules and layout.policy is policy
    assert str(layout) == f"{rules.name} data=4,tensor=2 precision={policy.name}"
    step = build_step(decoders.make("gpt", 0), OPTIMIZER, gpt_loss, layout)
    assert step.plan.rules is rules and step.plan.precision == policy


def test_compile_step_refuses_a_mesh_that_is_not_the_targets():
    with pytest.raises(aot.CompileError, match=r"^Layout.mesh data=4: h100x8 has 8 GPUs\. Fix: sizes whose product is 8"):
        aot.compile_step(nnx.eval_shape(lambda: decoders.make("gpt", 0)), OPTIMIZER, gpt_loss, "dp data=4",
                         aot.target("h100x8"), (8, 17))


def test_the_planners_remat_is_the_layouts():
    config = decoders.CONFIGS["llama"]
    by_layout = planner.estimate(planner.PlanInput(config, Layout.of("fsdp", dict(fsdp=8), remat="full")))
    by_model = planner.estimate(planner.PlanInput(config.__class__(**{**vars(config), "remat": "full"}),
                                            Layout.of("fsdp", dict(fsdp=8))))
    assert by_layout["memory_bytes_per_device"] == by_model["memory_bytes_per_device"]
    assert by_layout["memory_bytes_per_device"] != planner.estimate(planner.PlanInput(
        config, Layout.of("fsdp", dict(fsdp=8), remat="none")))["memory_bytes_per_device"]


@pytest.mark.parametrize("message, spoken", [
    ("Layout.grad_accum 2 = 16", "--grad-accum 2 = 16"),
    ("Layout.reduce='bf16'", "--grad-reduce='bf16'"),
    ("TrainConfig.batch_size 8 does not split; make TrainConfig.batch_size a multiple",
     "--batch-size 8 does not split; make --batch-size a multiple"),
    ("Layout.strategy auto: no layout of 8 cpu devices fits at Layout.remat none",
     "--strategy auto: no layout of 8 cpu devices fits at --remat none"),
    ("precision 'fp64': choose one of fp32, bf16", "precision 'fp64': choose one of fp32, bf16"),
])
def test_the_command_line_says_the_flag_where_the_library_says_the_field(message, spoken):
    assert flags.spoken(message) == spoken
