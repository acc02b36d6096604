"""`jshard plan`: will this fit, and will communication hide behind compute? Answered before
any device work, from the formulas in ../shared/SPEC.md, and checked against XLA.

    estimate.py       `estimate`: memory, communication and time per device, from the step's
                      own layout table on an abstract mesh (no devices), for a `PlanInput`
    planned_step.py  the step's plan without devices, and what the three estimates share of it
    hardware.py       the hardware profiles, and the link a group of mesh axes falls on
    memory.py         memory per device: training state, activations, the pipeline's buffers
    communication.py  the collectives' bytes per step, their calls and their time on the links
    timing.py         compute by term, exposed communication, the step time and MFU
    physics.py        what one GEMM, attention or collective costs on a device
    counts.py         widths and slots the formulas count of a decoder's config
    report_text.py    the estimate as the text `jshard plan` prints
    memory_chart.py   `--png`: the memory per device as stacked bars against the HBM
    search.py         every layout for a model and a device count, estimated and ranked
    validate.py       the same estimate for small steps built on fake CPU devices, against
                      `compiled.memory_analysis()` and the compiled HLO's collective bytes

The command line (the shared flags, a hardware profile and its overrides, `--validate`) is
`jshard.cli.plan`.
"""

from jshard.planner.planned_step import step_plan
from jshard.planner.communication import sends, traffic
from jshard.planner.estimate import PlanInput, estimate
from jshard.planner.hardware import GiB, HARDWARE, Hardware
from jshard.planner.memory import state_bytes
from jshard.planner.memory_chart import HBM_SCALE, MEMORY_COLOURS, PNG_DPI, UNITS, memory_png, memory_rows
from jshard.planner.report_text import report
from jshard.planner.validate import (MEMORY_TOLERANCE, MOE_VALIDATION, VALIDATION, VALIDATION_MODELS, format_validation,
                                  validate_one, validation_cases, within_tolerance)

__all__ = ["GiB", "HARDWARE", "HBM_SCALE", "MEMORY_COLOURS", "MEMORY_TOLERANCE", "MOE_VALIDATION", "PNG_DPI", "UNITS",
           "VALIDATION", "VALIDATION_MODELS", "Hardware", "PlanInput", "estimate", "format_validation", "step_plan",
           "memory_png", "memory_rows", "report", "sends", "state_bytes", "traffic", "validate_one", "validation_cases",
           "within_tolerance"]
