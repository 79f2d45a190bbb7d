"""The pre-flight point: every program of a run compiled, nothing sampled yet (``Trainer.compile``).

The trainer compiles each program at its largest shapes from its abstract arguments
(``train.programs``) before the first step, and the run then executes exactly those executables. Here
the compiler's own accounting of each one is read (:func:`program_memory`: ``memory_analysis()``);
:func:`check_fits` is where a run that would not fit its machine is refused before it starts (issue 23:
the budget of the machine and what the compiler does not count, exit 3). Today it records the numbers
in the details log and refuses nothing.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Mapping

import jax

from ict_jax.train.parts import RunParts

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class ProgramMemory:
    """Per-device bytes of one compiled program, as the compiler counts them."""

    name: str
    arguments: int
    temporaries: int
    outputs: int
    aliased: int  # outputs that reuse a donated argument's buffer
    code: int

    @property
    def live(self) -> int:
        """Peak bytes the program itself holds: arguments + outputs - aliased + temporaries + code."""
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code


def program_memory(name: str, compiled: jax.stages.Compiled) -> ProgramMemory:
    """``compiled.memory_analysis()`` of one program."""
    ma = compiled.memory_analysis()
    return ProgramMemory(name, int(ma.argument_size_in_bytes), int(ma.temp_size_in_bytes),
                         int(ma.output_size_in_bytes), int(ma.alias_size_in_bytes),
                         int(ma.generated_code_size_in_bytes))


def check_fits(parts: RunParts, compiled: Mapping[str, jax.stages.Compiled]) -> list[ProgramMemory]:
    """The programs' memory, read before anything is sampled (logged at INFO level); the check against
    the machine's budget belongs here (issue 23)."""
    memory = [program_memory(name, c) for name, c in compiled.items()]
    for m in memory:
        log.info("%s: %d bytes live a device (arguments %d, temporaries %d, outputs %d, aliased %d, code %d)",
                 m.name, m.live, m.arguments, m.temporaries, m.outputs, m.aliased, m.code)
    return memory
