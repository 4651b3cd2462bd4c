"""Read a TensorBoard log directory with tensorboard's own reader and print its scalars as JSON:
{tag: [[step, value], ...]}. Used by crates/train/tests/tensorboard_python.rs."""
import json
import sys

from tensorboard.backend.event_processing import event_accumulator

acc = event_accumulator.EventAccumulator(sys.argv[1], size_guidance={event_accumulator.SCALARS: 0})
acc.Reload()
out = {tag: [[e.step, e.value] for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
print(json.dumps(out))
