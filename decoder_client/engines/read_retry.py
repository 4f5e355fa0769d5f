"""When a draft model that its prices keep from reading has its reads timed again.

The beside rule prices a model's reads by what its reads have taken (moving averages), and a
model it prices out makes no reads: what they take is never timed again. So a price from a bad
moment would hold for good: reads timed while the host was busy, or one row at a time (an
engine's first request) where the rows of a batch would share each forward. After ``first``
steps on which every row was priced out, :class:`ReadRetry` has a step's reads timed anew
(:func:`decoder_client.engines.beside.time_reads`: two tokens read and a chain extended, as many
rows together as the batch has, on models that hold no request where an engine keeps one per
request, else on the model itself, which then reads its whole context when next asked), and the
rule is asked again on those times; then after twice as many steps each time that leaves it
priced out (at most ``most``). A model that cannot pay costs a step's worth of reads every
``first``, ``2 first``, ``4 first``, ... steps, and one whose reads got cheaper is found within
``first`` steps. A step on which the model read its price's way starts the count again.

>>> retry = ReadRetry(first=2, most=8)
>>> retry.after(read=False); retry.due()  # a step priced out
False
>>> retry.after(read=False); retry.due()  # two: the next has its reads timed again
True
>>> retry.retried(); retry.patience  # ... and, still priced out, the one after waits 4
4
>>> retry.after(read=True); retry.patience  # ... or the model paid, and reads its price's way
2
"""

from __future__ import annotations


class ReadRetry:
    """See the module docstring."""

    def __init__(self, first: int = 64, most: int = 4096) -> None:
        if not 1 <= first <= most:
            raise ValueError(f"need 1 <= first <= most, got first={first}, most={most}")
        self.first, self.most = first, most
        self.patience = first  # priced-out steps before the next retry
        self.quiet = 0  # priced-out steps since the model last read
        self.count = 0  # retries made

    def due(self) -> bool:
        """Whether a step on which every row is priced out has the model's reads timed again."""
        return self.quiet >= self.patience

    def after(self, read: bool) -> None:
        """A step on which the model's rows read their price's way (``read``), or were all
        priced out (a step on which none held a model or all waited for a price is neither)."""
        if read:
            self.quiet, self.patience = 0, self.first
        else:
            self.quiet += 1

    def retried(self) -> None:
        """This step had the model's reads timed again."""
        self.quiet, self.patience = 0, min(2 * self.patience, self.most)
        self.count += 1
