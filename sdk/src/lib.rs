//! Guest-side SDK for router handlers (filled in by the WASM handlers issue).
