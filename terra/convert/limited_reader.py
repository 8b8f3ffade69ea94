"""A read-only stream that refuses to hand out more than a byte budget.

A weight file from a stranger can declare any length (a gzip stream that inflates to terabytes,
a pickle opcode announcing a 10^12-byte string). :class:`LimitedReader` sits between the
decompressor and the parser and checks every request against what is left of the budget
*before* anything is read or allocated, so an oversized declaration costs nothing but an error.
Bytes the parser does not keep (a weight file's state and optimizer slots) are passed with
:meth:`LimitedReader.skip`, in pieces, against a second allowance: they cost time, not memory.
"""

from typing import BinaryIO

from terra.errors import CheckpointError

# A pickle's text opcodes (protocols 0-3: GLOBAL, INT, FLOAT, ...) end at a newline; none of
# Trax's is longer than a module path.
MAX_LINE_BYTES = 64 * 1024


def describe_bytes(n: int) -> str:
    """``n`` bytes in the unit a reader compares at a glance (MiB or GiB, one decimal)."""
    if n >= 1 << 60:  # past what a float prints exactly, and past any file
        return f"2^{n.bit_length() - 1} bytes or more"
    if n >= 1 << 30:
        return f"{n / (1 << 30):.1f} GiB"
    return f"{n / (1 << 20):.1f} MiB"


class LimitedReader:
    """``read``/``readline`` over ``stream``, at most ``budget`` bytes in all.

    ``what`` names the file in the error; ``why`` says what the budget is made of, so the
    message tells a user whether the file or the model description is wrong.
    """

    def __init__(self, stream: BinaryIO, budget: int, what: str, why: str, skip_budget: int = 0, skip_why: str = ""):
        self._stream = stream
        self.remaining = int(budget)
        self.budget = int(budget)
        self._what = what
        self._why = why
        self.skipped = 0
        self.skip_budget = int(skip_budget)
        self._skip_why = skip_why

    @property
    def consumed(self) -> int:
        return self.budget - self.remaining

    def _refuse(self, wanted: int) -> CheckpointError:
        skipped = f" (besides {describe_bytes(self.skipped)} read past)" if self.skipped else ""
        return CheckpointError(
            f"{self._what} asks for {describe_bytes(self.consumed + wanted)} once decompressed{skipped}, more than "
            f"the {describe_bytes(self.budget)} {self._why}; it was not read further. Check that the file belongs "
            "to the model described (--trax_config or --gin_file)."
        )

    def skip(self, n: int) -> int:
        """Pass up to ``n`` bytes (read in pieces of at most 1 MiB and dropped) against the skip
        allowance; returns how many there were (0 at the end)."""
        if self.skipped + n > self.skip_budget:
            raise CheckpointError(
                f"{self._what} holds more than {describe_bytes(self.skip_budget)} besides the weights "
                f"({describe_bytes(self.skipped + n)} so far), the most {self._skip_why}; it was not read further. "
                "Save the model's weights alone (a model in 'eval' mode, Layer.save_to_file) and convert that."
            )
        passed = 0
        while passed < n:
            piece = self._stream.read(min(n - passed, 1 << 20))
            if not piece:
                break
            passed += len(piece)
        self.skipped += passed
        return passed

    def at_end(self) -> bool:
        """Whether the stream ends here (whatever is left of the budget): reads on, one byte, so
        that a gzip stream checks its CRC and length, which it does only on reaching its end."""
        return not self._stream.read(1)

    def _take(self, n: int) -> None:
        if n < 0:
            raise CheckpointError(f"{self._what}: a negative length was declared; the file is damaged.")
        if n > self.remaining:
            raise self._refuse(n)
        self.remaining -= n

    def read(self, n: int = -1) -> bytes:
        if n is None or n < 0:
            n = self.remaining + 1  # read to the end, which must fit the budget
            data = self._stream.read(n)
            if len(data) > self.remaining:
                raise self._refuse(len(data))
            self.remaining -= len(data)
            return data
        self._take(n)
        data = self._stream.read(n)
        self.remaining += n - len(data)  # a short read at the end consumes only what it returned
        return data

    def readline(self, size: int = -1) -> bytes:
        limit = MAX_LINE_BYTES if size is None or size < 0 else min(size, MAX_LINE_BYTES)
        limit = min(limit, self.remaining + 1)
        line = self._stream.readline(limit)
        if len(line) > self.remaining:
            raise self._refuse(len(line))
        if len(line) == limit and not line.endswith(b"\n"):
            raise CheckpointError(
                f"{self._what} holds a text line longer than {MAX_LINE_BYTES} bytes; it is not a Trax weight file."
            )
        self.remaining -= len(line)
        return line
