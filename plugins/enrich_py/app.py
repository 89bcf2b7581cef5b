"""enrich_py: the `enrich` handler written in Python, built with componentize-py.

Emits one derived event `<type>.enriched` whose data is the input data plus
`{"enriched": true, "len": <number of keys in the input data>}` -- the same result as the Rust
`enrich` plugin, proving the handler interface is not Rust-only.
"""

import json
from typing import List

import wit_world
from componentize_py_types import Err
from wit_world.imports import log, types


class WitWorld(wit_world.WitWorld):
    def describe(self) -> types.Descriptor:
        return types.Descriptor(name="enrich_py", version="0.1.0", accepts=[])

    def handle(self, event: types.Event, delivery: types.Delivery) -> List[types.Emitted]:
        try:
            data = json.loads(event.data) if event.data is not None else None
        except ValueError as e:
            raise Err(types.HandlerError_Fail(f"invalid JSON data: {e}"))
        if not isinstance(data, dict):
            raise Err(types.HandlerError_Fail("data must be a JSON object"))
        length = len(data)
        data["enriched"] = True
        data["len"] = length
        log.log(log.Level.DEBUG, f"enriched event {event.id} ({length} keys)")
        return [
            types.Emitted(
                type=f"{event.type}.enriched",
                subject=event.subject,
                datacontenttype=None,
                data=json.dumps(data, separators=(",", ":"), ensure_ascii=False),
                extensions=[],
            )
        ]
