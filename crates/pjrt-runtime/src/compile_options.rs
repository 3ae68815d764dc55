//! The serialized `xla.CompileOptionsProto` that `PJRT_Client_Compile` takes.
//!
//! Only three fields are ever set, so they are written by hand in protobuf's wire format instead
//! of pulling in a protobuf code generator and XLA's `.proto` files:
//!
//! ```text
//! CompileOptionsProto         { ExecutableBuildOptionsProto executable_build_options = 3; }
//! ExecutableBuildOptionsProto { int64 device_ordinal = 1; int64 num_replicas = 4; int64 num_partitions = 5; }
//! ```

/// What a compilation is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CompileOptions {
    /// Replicas of the program (1: one device runs it).
    pub num_replicas: u32,
    /// SPMD partitions (1: not partitioned).
    pub num_partitions: u32,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions { num_replicas: 1, num_partitions: 1 }
    }
}

fn varint(out: &mut Vec<u8>, mut value: u64) {
    loop {
        let byte = (value & 0x7f) as u8;
        value >>= 7;
        if value == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

/// A field key: field number and wire type (0 = varint, 2 = length-delimited).
fn key(out: &mut Vec<u8>, field: u32, wire_type: u8) {
    varint(out, (u64::from(field) << 3) | u64::from(wire_type));
}

impl CompileOptions {
    /// The options as serialized `CompileOptionsProto` bytes.
    pub fn to_proto_bytes(&self) -> Vec<u8> {
        let mut build = Vec::new();
        key(&mut build, 4, 0);
        varint(&mut build, u64::from(self.num_replicas));
        key(&mut build, 5, 0);
        varint(&mut build, u64::from(self.num_partitions));
        let mut out = Vec::new();
        key(&mut out, 3, 2);
        varint(&mut out, build.len() as u64);
        out.extend_from_slice(&build);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wire_format() {
        // field 3, length 4: (field 4 = 1), (field 5 = 1)
        assert_eq!(CompileOptions::default().to_proto_bytes(), vec![0x1a, 4, 0x20, 1, 0x28, 1]);
        let mut out = Vec::new();
        varint(&mut out, 300);
        assert_eq!(out, vec![0xac, 0x02]);
    }
}
