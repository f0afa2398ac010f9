//! The framing of kvfork's state files: a versioned header (kind, model identity, length,
//! checksum) around a payload written with [`Writer`] and read back with [`Reader`], whose
//! every read is bounds-checked. A corrupt, truncated or foreign file is an error, never a
//! panic: the payload is only parsed after its length and checksum are verified.

use std::fmt;

/// First bytes of every kvfork state file.
pub const MAGIC: [u8; 8] = *b"KVFORK\0S";
/// Bumped whenever the payload layout changes (2: a branch's record holds its history; 3: and
/// its adapters; 4: its last output is a row or a device draw).
pub const VERSION: u32 = 4;
const HEADER_LEN: usize = 8 + 4 + 4 + 8 + 8 + 8;

/// What a state file holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// One branch (`Branch.save`).
    Branch = 1,
    /// A whole context: every live branch and the KV cache (`Context.save_state`).
    Context = 2,
}

impl Kind {
    fn name(v: u32) -> &'static str {
        match v {
            1 => "a branch",
            2 => "a context",
            _ => "an unknown kind of state",
        }
    }
}

/// Why a state file was refused.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum StateError {
    /// The file does not start with kvfork's magic bytes.
    NotAStateFile,
    /// Written by another version of the format (the version it names).
    Version(u32),
    /// A state file of another kind (a branch where a context was expected, or the reverse).
    WrongKind {
        /// The kind the caller asked for.
        expected: Kind,
        /// The kind tag in the file.
        found: u32,
    },
    /// Saved with another model (its identity differs).
    OtherModel,
    /// Shorter than its header or a length inside it says.
    Truncated,
    /// The payload does not match its checksum (corrupt).
    Checksum,
    /// The payload parsed but is inconsistent (a bad value at a named place).
    Malformed(String),
}

impl fmt::Display for StateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            StateError::NotAStateFile => write!(f, "not a kvfork state file"),
            StateError::Version(v) => write!(
                f,
                "state file format version {v} is not supported (this kvfork reads {VERSION})"
            ),
            StateError::WrongKind { expected, found } => write!(
                f,
                "the file holds {}, not {}",
                Kind::name(*found),
                Kind::name(*expected as u32)
            ),
            StateError::OtherModel => write!(f, "the file was saved with a different model"),
            StateError::Truncated => write!(f, "the file is truncated"),
            StateError::Checksum => write!(f, "the file is corrupt (checksum mismatch)"),
            StateError::Malformed(what) => write!(f, "the file is corrupt: {what}"),
        }
    }
}

impl std::error::Error for StateError {}

/// A 64-bit checksum of `bytes` (word-wise FNV-1a variant: detects corruption, not tampering).
pub fn checksum(bytes: &[u8]) -> u64 {
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ bytes.len() as u64;
    let mut words = bytes.chunks_exact(8);
    for w in &mut words {
        let v = u64::from_le_bytes(w.try_into().expect("8 bytes"));
        h = (h ^ v).wrapping_mul(PRIME).rotate_left(29);
    }
    for &b in words.remainder() {
        h = (h ^ u64::from(b)).wrapping_mul(PRIME);
    }
    h ^ (h >> 32)
}

/// Header + payload, ready to write to a file.
pub fn seal(kind: Kind, model_id: u64, payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::with_capacity(HEADER_LEN + payload.len());
    out.extend_from_slice(&MAGIC);
    out.extend_from_slice(&VERSION.to_le_bytes());
    out.extend_from_slice(&(kind as u32).to_le_bytes());
    out.extend_from_slice(&model_id.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&checksum(payload).to_le_bytes());
    out.extend_from_slice(payload);
    out
}

/// The payload of a sealed file, after checking magic, version, kind, model and checksum.
pub fn open(file: &[u8], kind: Kind, model_id: u64) -> Result<&[u8], StateError> {
    if file.len() < MAGIC.len() || file[..MAGIC.len()] != MAGIC {
        return Err(StateError::NotAStateFile);
    }
    let mut r = Reader::new(&file[MAGIC.len()..]);
    let version = r.u32()?;
    if version != VERSION {
        return Err(StateError::Version(version));
    }
    let found = r.u32()?;
    if found != kind as u32 {
        return Err(StateError::WrongKind {
            expected: kind,
            found,
        });
    }
    if r.u64()? != model_id {
        return Err(StateError::OtherModel);
    }
    let len = r.u64()?;
    let sum = r.u64()?;
    let payload = r.rest();
    if (payload.len() as u64) < len {
        return Err(StateError::Truncated);
    }
    if payload.len() as u64 != len {
        return Err(StateError::Malformed(
            "trailing bytes after the payload".into(),
        ));
    }
    if checksum(payload) != sum {
        return Err(StateError::Checksum);
    }
    Ok(payload)
}

/// Little-endian payload writer.
#[derive(Default)]
pub struct Writer {
    buf: Vec<u8>,
}

impl Writer {
    /// An empty payload.
    pub fn new() -> Self {
        Self::default()
    }

    /// The bytes written.
    pub fn into_bytes(self) -> Vec<u8> {
        self.buf
    }

    /// One byte.
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }

    /// A boolean as one byte, 0 or 1.
    pub fn bool(&mut self, v: bool) -> &mut Self {
        self.u8(v as u8)
    }

    /// A `u32`, little-endian.
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// An `i32`, little-endian.
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// A `u64`, little-endian.
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// An `f32`, little-endian (bit-exact).
    pub fn f32(&mut self, v: f32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// An `f64`, little-endian (bit-exact).
    pub fn f64(&mut self, v: f64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }

    /// Length-prefixed bytes.
    pub fn bytes(&mut self, v: &[u8]) -> &mut Self {
        self.u64(v.len() as u64);
        self.buf.extend_from_slice(v);
        self
    }

    /// Length-prefixed UTF-8.
    pub fn str(&mut self, v: &str) -> &mut Self {
        self.bytes(v.as_bytes())
    }

    /// A length-prefixed list of `i32`.
    pub fn i32s(&mut self, v: &[i32]) -> &mut Self {
        self.u64(v.len() as u64);
        v.iter().for_each(|&x| {
            self.i32(x);
        });
        self
    }

    /// A length-prefixed list of `f32`.
    pub fn f32s(&mut self, v: &[f32]) -> &mut Self {
        self.u64(v.len() as u64);
        v.iter().for_each(|&x| {
            self.f32(x);
        });
        self
    }
}

/// Bounds-checked little-endian payload reader.
pub struct Reader<'a> {
    rest: &'a [u8],
}

impl<'a> Reader<'a> {
    /// A reader of `bytes` from the start.
    pub fn new(bytes: &'a [u8]) -> Self {
        Reader { rest: bytes }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8], StateError> {
        if self.rest.len() < n {
            return Err(StateError::Truncated);
        }
        let (head, tail) = self.rest.split_at(n);
        self.rest = tail;
        Ok(head)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], StateError> {
        Ok(self.take(N)?.try_into().expect("N bytes"))
    }

    /// Everything not read yet.
    pub fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.rest)
    }

    /// Fails unless every byte was read.
    pub fn finish(&self) -> Result<(), StateError> {
        if self.rest.is_empty() {
            Ok(())
        } else {
            Err(StateError::Malformed("unread bytes at the end".into()))
        }
    }

    /// One byte.
    pub fn u8(&mut self) -> Result<u8, StateError> {
        Ok(self.array::<1>()?[0])
    }

    /// A boolean: a byte that must be 0 or 1.
    pub fn bool(&mut self) -> Result<bool, StateError> {
        match self.u8()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(StateError::Malformed(format!("{v} is not a boolean"))),
        }
    }

    /// A little-endian `u32`.
    pub fn u32(&mut self) -> Result<u32, StateError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    /// A little-endian `i32`.
    pub fn i32(&mut self) -> Result<i32, StateError> {
        Ok(i32::from_le_bytes(self.array()?))
    }

    /// A little-endian `u64`.
    pub fn u64(&mut self) -> Result<u64, StateError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    /// A little-endian `f32`.
    pub fn f32(&mut self) -> Result<f32, StateError> {
        Ok(f32::from_le_bytes(self.array()?))
    }

    /// A little-endian `f64`.
    pub fn f64(&mut self) -> Result<f64, StateError> {
        Ok(f64::from_le_bytes(self.array()?))
    }

    /// A length prefix, refused when it exceeds the bytes left (`unit` bytes per item).
    fn len(&mut self, unit: usize) -> Result<usize, StateError> {
        let n = self.u64()?;
        match usize::try_from(n).ok().and_then(|n| n.checked_mul(unit)) {
            Some(bytes) if bytes <= self.rest.len() => Ok(n as usize),
            _ => Err(StateError::Truncated),
        }
    }

    /// Length-prefixed bytes, borrowed from the input.
    pub fn bytes(&mut self) -> Result<&'a [u8], StateError> {
        let n = self.len(1)?;
        self.take(n)
    }

    /// Length-prefixed UTF-8.
    pub fn str(&mut self) -> Result<String, StateError> {
        let b = self.bytes()?;
        String::from_utf8(b.to_vec()).map_err(|_| StateError::Malformed("invalid UTF-8".into()))
    }

    /// A length-prefixed list of `i32`.
    pub fn i32s(&mut self) -> Result<Vec<i32>, StateError> {
        let n = self.len(4)?;
        (0..n).map(|_| self.i32()).collect()
    }

    /// A length-prefixed list of `f32`.
    pub fn f32s(&mut self) -> Result<Vec<f32>, StateError> {
        let n = self.len(4)?;
        (0..n).map(|_| self.f32()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample_payload() -> Vec<u8> {
        let mut w = Writer::new();
        w.u8(7)
            .bool(true)
            .u32(1 << 31)
            .i32(-5)
            .u64(u64::MAX)
            .f32(1.5)
            .f64(f64::INFINITY)
            .str("héllo")
            .i32s(&[1, -2, 3])
            .f32s(&[0.25]);
        w.into_bytes()
    }

    #[test]
    fn round_trip() {
        let file = seal(Kind::Branch, 42, &sample_payload());
        let payload = open(&file, Kind::Branch, 42).unwrap();
        let mut r = Reader::new(payload);
        assert_eq!(r.u8().unwrap(), 7);
        assert!(r.bool().unwrap());
        assert_eq!(r.u32().unwrap(), 1 << 31);
        assert_eq!(r.i32().unwrap(), -5);
        assert_eq!(r.u64().unwrap(), u64::MAX);
        assert_eq!(r.f32().unwrap(), 1.5);
        assert_eq!(r.f64().unwrap(), f64::INFINITY);
        assert_eq!(r.str().unwrap(), "héllo");
        assert_eq!(r.i32s().unwrap(), vec![1, -2, 3]);
        assert_eq!(r.f32s().unwrap(), vec![0.25]);
        r.finish().unwrap();
    }

    #[test]
    fn refuses_foreign_files() {
        let file = seal(Kind::Branch, 42, &sample_payload());
        assert_eq!(
            open(b"GGUF....", Kind::Branch, 42),
            Err(StateError::NotAStateFile)
        );
        assert_eq!(open(&file, Kind::Branch, 43), Err(StateError::OtherModel));
        assert_eq!(
            open(&file, Kind::Context, 42),
            Err(StateError::WrongKind {
                expected: Kind::Context,
                found: 1
            })
        );
        let mut other = file.clone();
        other[8] = (VERSION + 1) as u8;
        assert_eq!(
            open(&other, Kind::Branch, 42),
            Err(StateError::Version(VERSION + 1))
        );
        other[8] = 1; // the format before a branch's history was saved
        assert_eq!(open(&other, Kind::Branch, 42), Err(StateError::Version(1)));
    }

    #[test]
    fn every_truncation_and_every_flipped_bit_is_refused() {
        let file = seal(Kind::Context, 1, &sample_payload());
        for cut in 0..file.len() {
            assert!(
                open(&file[..cut], Kind::Context, 1).is_err(),
                "cut at {cut}"
            );
        }
        for i in 0..file.len() {
            for bit in 0..8 {
                let mut bad = file.clone();
                bad[i] ^= 1 << bit;
                assert!(open(&bad, Kind::Context, 1).is_err(), "byte {i} bit {bit}");
            }
        }
    }

    #[test]
    fn reader_refuses_lengths_beyond_the_data() {
        let mut w = Writer::new();
        w.u64(u64::MAX);
        assert_eq!(
            Reader::new(&w.into_bytes()).bytes(),
            Err(StateError::Truncated)
        );
        let mut w = Writer::new();
        w.u64(3).i32(1);
        assert_eq!(
            Reader::new(&w.into_bytes()).i32s(),
            Err(StateError::Truncated)
        );
        assert!(Reader::new(&[2]).bool().is_err());
    }
}
