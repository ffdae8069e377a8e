//! Conformance tests live in tests/.
