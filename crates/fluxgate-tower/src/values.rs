//! Header values written without an allocation of their own.
//!
//! A `HeaderValue` owns its bytes through a `Bytes`; made from a number or a string it
//! allocates for each response. Here each thread writes its values one after the other into
//! a chunk of [`CHUNK`] bytes, and each value is a slice of that chunk: writing one costs a
//! copy and a reference count, and a new chunk is allocated only when the current one is
//! used up (about once per hundred responses). A chunk is freed when the last response
//! holding one of its values is dropped, so a response kept for long holds at most one
//! chunk.

use std::cell::RefCell;

use bytes::BytesMut;
use http::HeaderValue;

/// The size of a thread's chunk.
const CHUNK: usize = 8 * 1024;

/// The longest value written into a chunk; longer ones get their own allocation.
const MAX_IN_CHUNK: usize = 256;

/// A value being written: a fixed buffer on the stack.
pub(crate) struct ValueBuf {
    buf: [u8; MAX_IN_CHUNK],
    len: usize,
    /// Set when the value outgrew the buffer; it is then written again into a `Vec`.
    overflow: Option<Vec<u8>>,
}

impl ValueBuf {
    pub(crate) fn new() -> Self {
        Self {
            buf: [0; MAX_IN_CHUNK],
            len: 0,
            overflow: None,
        }
    }

    pub(crate) fn push(&mut self, bytes: &[u8]) {
        if let Some(v) = &mut self.overflow {
            v.extend_from_slice(bytes);
            return;
        }
        let end = self.len + bytes.len();
        if end <= self.buf.len() {
            self.buf[self.len..end].copy_from_slice(bytes);
            self.len = end;
        } else {
            let mut v = Vec::with_capacity(end * 2);
            v.extend_from_slice(&self.buf[..self.len]);
            v.extend_from_slice(bytes);
            self.overflow = Some(v);
        }
    }

    pub(crate) fn push_u64(&mut self, n: u64) {
        self.push(itoa::Buffer::new().format(n).as_bytes());
    }

    /// The header value. Only visible ASCII is ever written (numbers, ids, labels and
    /// punctuation), so it is always valid; an empty value stands in otherwise.
    pub(crate) fn finish(self) -> HeaderValue {
        if let Some(v) = self.overflow {
            return HeaderValue::from_bytes(&v).unwrap_or_else(|_| HeaderValue::from_static(""));
        }
        let bytes = &self.buf[..self.len];
        thread_local! {
            static CURRENT: RefCell<BytesMut> = RefCell::new(BytesMut::new());
        }
        CURRENT.with(|current| {
            let mut chunk = current.borrow_mut();
            if chunk.capacity() - chunk.len() < bytes.len() {
                // The old chunk lives on in the values cut from it.
                *chunk = BytesMut::with_capacity(CHUNK);
            }
            chunk.extend_from_slice(bytes);
            HeaderValue::from_maybe_shared(chunk.split().freeze()).unwrap_or_else(|_| HeaderValue::from_static(""))
        })
    }
}

/// A number as a header value.
pub(crate) fn number(n: u64) -> HeaderValue {
    let mut v = ValueBuf::new();
    v.push_u64(n);
    v.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_survive_new_chunks_and_long_values() {
        let mut kept = Vec::new();
        for n in 0..5_000u64 {
            kept.push((n, number(n * 1_000_003)));
        }
        for (n, v) in &kept {
            assert_eq!(v.to_str().unwrap(), (n * 1_000_003).to_string());
        }
        let mut long = ValueBuf::new();
        for _ in 0..100 {
            long.push(b"\"rule\";r=1;");
        }
        assert_eq!(long.finish().len(), 1_100);
        let mut bad = ValueBuf::new();
        bad.push(b"a\nb");
        assert_eq!(bad.finish(), "");
    }
}
