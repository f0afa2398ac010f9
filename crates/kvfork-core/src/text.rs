//! A branch's text, token by token: a token's piece may end inside a multi-byte UTF-8
//! character (byte-level vocabularies split them), so the unfinished bytes wait for the next.

/// Bytes of an unfinished UTF-8 character, carried from one token's piece to the next.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Utf8Carry {
    pending: Vec<u8>,
}

impl Utf8Carry {
    /// The text `piece` completes: the carried bytes plus `piece`, up to the last complete
    /// character. An unfinished character at the end (at most 3 bytes) is carried when
    /// `commit` is true, and left alone otherwise (a preview). Invalid bytes, as opposed to
    /// merely unfinished ones, are emitted as U+FFFD.
    pub fn push(&mut self, piece: &[u8], commit: bool) -> String {
        let mut bytes = Vec::with_capacity(self.pending.len() + piece.len());
        bytes.extend_from_slice(&self.pending);
        bytes.extend_from_slice(piece);
        let complete = match std::str::from_utf8(&bytes) {
            Ok(_) => bytes.len(),
            Err(e) if e.error_len().is_none() && bytes.len() - e.valid_up_to() < 4 => {
                e.valid_up_to()
            }
            Err(_) => bytes.len(),
        };
        let text = String::from_utf8_lossy(&bytes[..complete]).into_owned();
        if commit {
            bytes.drain(..complete);
            self.pending = bytes;
        }
        text
    }

    /// The carried bytes (saved with a branch).
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// A carry holding `bytes` (a saved branch's).
    pub fn from_pending(bytes: Vec<u8>) -> Self {
        Utf8Carry { pending: bytes }
    }
}

#[cfg(test)]
mod tests {
    use super::Utf8Carry;
    use proptest::prelude::*;

    #[test]
    fn a_split_character_waits_for_its_last_byte() {
        let mut c = Utf8Carry::default();
        let euro = "€".as_bytes(); // 3 bytes
        assert_eq!(c.push(&euro[..1], true), "");
        assert_eq!(c.push(&euro[1..2], true), "");
        assert_eq!(c.push(&euro[2..], true), "€");
        assert!(c.pending().is_empty());
    }

    #[test]
    fn a_preview_leaves_the_carry_alone() {
        let mut c = Utf8Carry::default();
        c.push(&"é".as_bytes()[..1], true);
        assert_eq!(c.push(&"é".as_bytes()[1..], false), "é");
        assert_eq!(c.pending(), &"é".as_bytes()[..1]);
    }

    #[test]
    fn invalid_bytes_are_replaced_not_carried() {
        let mut c = Utf8Carry::default();
        assert_eq!(c.push(&[0xff, b'a'], true), "\u{fffd}a");
        assert!(c.pending().is_empty());
    }

    proptest! {
        /// Any split of valid text into pieces gives back the text, whole characters only.
        #[test]
        fn pieces_join_to_the_text(text in "\\PC{0,40}", cuts in prop::collection::vec(0usize..200, 0..12)) {
            let bytes = text.as_bytes();
            let mut at: Vec<usize> = cuts.into_iter().map(|c| c % (bytes.len() + 1)).collect();
            at.push(0);
            at.push(bytes.len());
            at.sort_unstable();
            let mut carry = Utf8Carry::default();
            let mut out = String::new();
            for w in at.windows(2) {
                out.push_str(&carry.push(&bytes[w[0]..w[1]], true));
            }
            prop_assert_eq!(out, text);
            prop_assert!(carry.pending().is_empty());
        }
    }
}
