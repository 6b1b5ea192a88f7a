"""``freescale.device.Streams`` on a CUDA GPU: each ordering call makes a race visible every time.

The producer's stream is held busy by a spinning kernel before it writes, so a reader on
another stream that was not told to wait runs first and sees the old bytes; a tensor freed
while another stream will still read it is handed out again at once (the allocator's cache is
emptied first), so its next owner's bytes show up. Each test runs with the call under test
and, as a check that the test can see the bug, once without it: the result must then be wrong.

Torch tier of the GPU check (``scripts/gpu_check.sh --tier torch``): torch and FreeScale's
torch-only modules.
"""

import pytest
import torch

from freescale.device import Streams
from helpers.cuda import full, hold, settled

pytestmark = pytest.mark.gpu

WITH_AND_WITHOUT = pytest.mark.parametrize("ordered", [True, False], ids=["with-the-call", "without-it"])


@WITH_AND_WITHOUT
def test_on_makes_the_side_stream_wait_for_what_the_current_stream_wrote(ordered):
    streams = Streams("cuda")
    side = streams.side()
    x = full(0.0)
    settled()
    hold()  # the current stream is busy ...
    x.fill_(1.0)  # ... then writes x
    with streams.on(side) if ordered else torch.cuda.stream(side):
        y = x.clone()  # read on the side stream
    torch.cuda.synchronize()
    assert torch.equal(y, full(1.0 if ordered else 0.0))  # unordered, the read ran before the write


@WITH_AND_WITHOUT
def test_take_makes_the_current_stream_wait_for_the_producer(ordered):
    streams = Streams("cuda")
    side = streams.side()
    with torch.cuda.stream(side):
        y = full(0.0)
    settled()
    with streams.on(side):
        hold()  # the side stream is busy ...
        y.fill_(1.0)  # ... then writes y
    if ordered:
        y = streams.take(y, side)
    z = y.clone()  # read on the current stream
    torch.cuda.synchronize()
    assert torch.equal(z, full(1.0 if ordered else 0.0))


@WITH_AND_WITHOUT
def test_take_keeps_the_producers_memory_until_the_consumer_has_read_it(ordered):
    streams = Streams("cuda")
    side = streams.side()
    settled()
    with torch.cuda.stream(side):
        y = full(1.0)  # made on the side stream
    if ordered:
        y = streams.take(y, side)
    else:
        torch.cuda.current_stream().wait_stream(side)  # take's wait, without its record_stream
    hold()  # the consumer is busy ...
    z = y.clone()  # ... then reads y
    freed = y.data_ptr()
    del y  # the producer's side drops its tensor
    with torch.cuda.stream(side):
        w = full(2.0)  # the side stream's next tensor of that size
    torch.cuda.synchronize()
    assert (w.data_ptr() == freed) is not ordered  # unmarked, the block was handed out at once
    assert torch.equal(z, full(1.0 if ordered else 2.0))


@WITH_AND_WITHOUT
def test_hand_over_keeps_memory_made_here_until_the_side_stream_has_read_it(ordered):
    streams = Streams("cuda")
    side = streams.side()
    settled()
    x = full(1.0)  # made on the current stream
    if ordered:
        streams.hand_over(x, side)
    with streams.on(side):
        hold()  # the side stream is busy ...
        z = x.clone()  # ... then reads x
    freed = x.data_ptr()
    del x
    w = full(2.0)  # the current stream's next tensor of that size
    torch.cuda.synchronize()
    assert (w.data_ptr() == freed) is not ordered
    assert torch.equal(z, full(1.0 if ordered else 2.0))


def test_side_stream_work_reads_what_the_compute_stream_wrote_and_is_waited_for():
    streams = Streams("cuda")
    side = streams.side()
    a = torch.randn(4096, 4096, device="cuda")
    for k in range(3):
        x = a @ a  # long enough that an unordered reader would see the old values
        x.add_(k)
        with streams.on(side):
            y = x.sum(dim=0)
        y = streams.take(y, side)
        torch.testing.assert_close(y, x.sum(dim=0), rtol=0, atol=0)
