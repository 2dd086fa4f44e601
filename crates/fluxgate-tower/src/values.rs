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

use bytes::{Bytes, BytesMut};
use http::HeaderValue;

/// The size of a thread's chunk.
const CHUNK: usize = 8 * 1024;

thread_local! {
    static CURRENT: RefCell<BytesMut> = RefCell::new(BytesMut::new());
}

/// A value being written, straight into the thread's chunk.
pub(crate) struct ValueBuf<'a> {
    chunk: &'a mut BytesMut,
}

impl ValueBuf<'_> {
    /// Appends bytes. The chunk grows if it must (it is then renewed after this value).
    pub(crate) fn push(&mut self, bytes: &[u8]) {
        self.chunk.extend_from_slice(bytes);
    }

    pub(crate) fn push_u64(&mut self, n: u64) {
        self.push(itoa::Buffer::new().format(n).as_bytes());
    }
}

/// A header value written by `write`. Only visible ASCII is ever written (numbers, ids,
/// labels and punctuation), so it is always valid; an empty value stands in otherwise.
pub(crate) fn value(write: impl FnOnce(&mut ValueBuf<'_>)) -> HeaderValue {
    let finish = |chunk: &mut BytesMut| {
        HeaderValue::from_maybe_shared(chunk.split().freeze()).unwrap_or_else(|_| HeaderValue::from_static(""))
    };
    let mut write = Some(write);
    let mut run = |chunk: &mut BytesMut| {
        if let Some(write) = write.take() {
            write(&mut ValueBuf { chunk });
        }
        finish(chunk)
    };
    let from_chunk = CURRENT.try_with(|current| {
        let mut chunk = current.borrow_mut();
        // Room for the usual value; a longer one makes the chunk grow.
        if chunk.capacity() - chunk.len() < 128 {
            // The old chunk lives on in the values cut from it.
            *chunk = BytesMut::with_capacity(CHUNK);
        }
        run(&mut chunk)
    });
    // At thread exit, without the chunk: a value of its own.
    from_chunk.unwrap_or_else(|_| run(&mut BytesMut::new()))
}

/// The numbers below [`SMALL`] as four digits each, leading zeros included: a value of
/// one of them is a slice of this table, with nothing written, counted or freed.
static DIGITS: [[u8; 4]; SMALL as usize] = {
    let mut table = [[0u8; 4]; SMALL as usize];
    let mut n = 0;
    while n < SMALL as usize {
        table[n] = [
            b'0' + (n / 1000 % 10) as u8,
            b'0' + (n / 100 % 10) as u8,
            b'0' + (n / 10 % 10) as u8,
            b'0' + (n % 10) as u8,
        ];
        n += 1;
    }
    table
};

/// Numbers below this come from [`DIGITS`].
pub(crate) const SMALL: u64 = 10_000;

/// A number as a header value.
pub(crate) fn number(n: u64) -> HeaderValue {
    if n < SMALL {
        let digits = &DIGITS[n as usize];
        let skip = usize::from(n < 1000) + usize::from(n < 100) + usize::from(n < 10);
        if let Ok(value) = HeaderValue::from_maybe_shared(Bytes::from_static(&digits[skip..])) {
            return value;
        }
    }
    value(|v| v.push_u64(n))
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
        let long = value(|v| {
            for _ in 0..1_000 {
                v.push(b"\"rule\";r=1;");
            }
        });
        assert_eq!(long.len(), 11_000);
        assert_eq!(number(42), "42");
        assert_eq!(value(|v| v.push(b"a\nb")), "");
        assert_eq!(number(7), "7");
        for n in (0..=10_001).chain([99_999, 100_000, u64::MAX]) {
            assert_eq!(number(n).to_str().unwrap(), n.to_string());
        }
    }
}
