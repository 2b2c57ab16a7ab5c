//! Multipart uploads a killed criuz left behind. A criuz that dies while
//! writing an archive cannot abort its upload, and S3 keeps the parts
//! (stored and billed, invisible to a plain listing) until someone aborts
//! them or a lifecycle rule does. So after an upload completes, criuz
//! aborts the other incomplete uploads of the same key: those of earlier
//! writers that died, and that of a writer racing it for the key, which
//! then fails loudly instead of replacing the archive just written. Keys
//! that are never written again keep theirs: docs/object-storage.md
//! recommends the lifecycle rule.
//!
//! `object_store` has no call that lists multipart uploads, so the listing
//! is one presigned `GET ?uploads&prefix=KEY` (signed by `object_store`,
//! sent by the same `reqwest` it uses); the abort is `object_store`'s own.

use super::{runtime, ObjectUrl};
use object_store::aws::AmazonS3;
use object_store::multipart::MultipartStore;
use object_store::signer::{Method, SignedUrlOptions, Signer};
use std::time::Duration;

/// Aborts the incomplete uploads of `url`'s key; returns how many. Best
/// effort: what the server refuses is reported, never fatal.
pub(super) fn abort_others(store: &AmazonS3, url: &ObjectUrl) -> Result<usize, String> {
    runtime().block_on(async {
        let opts = SignedUrlOptions::default().with_query([("uploads", ""), ("prefix", url.key.as_str())]);
        let listing = store
            .signed_url_opts(Method::GET, &object_store::path::Path::from(""), Duration::from_secs(300), &opts)
            .await
            .map_err(|e| e.to_string())?;
        let reply = reqwest::get(listing).await.map_err(|e| e.to_string())?;
        if !reply.status().is_success() {
            return Err(format!("listing multipart uploads: HTTP {}", reply.status()));
        }
        let body = reply.text().await.map_err(|e| e.to_string())?;
        let mut aborted = 0;
        for (key, id) in uploads(&body) {
            if key == url.key {
                let path = object_store::path::Path::from(key.as_str());
                store.abort_multipart(&path, &id).await.map_err(|e| e.to_string())?;
                aborted += 1;
            }
        }
        Ok(aborted)
    })
}

/// (Key, UploadId) of each `<Upload>` in a ListMultipartUploads reply.
fn uploads(xml: &str) -> Vec<(String, String)> {
    xml.split("<Upload>")
        .skip(1)
        .filter_map(|u| {
            let u = &u[..u.find("</Upload>")?];
            Some((unescape(tag(u, "Key")?), tag(u, "UploadId")?.to_string()))
        })
        .collect()
}

fn tag<'a>(xml: &'a str, name: &str) -> Option<&'a str> {
    let start = xml.find(&format!("<{name}>"))? + name.len() + 2;
    let len = xml[start..].find(&format!("</{name}>"))?;
    Some(&xml[start..start + len])
}

/// XML's five predefined entities (a key may hold `&` or `<`).
fn unescape(s: &str) -> String {
    s.replace("&lt;", "<").replace("&gt;", ">").replace("&quot;", "\"").replace("&apos;", "'").replace("&amp;", "&")
}

#[cfg(test)]
mod tests {
    #[test]
    fn uploads_are_read_from_the_listing() {
        let xml = "<ListMultipartUploadsResult><Bucket>b</Bucket>\
            <Upload><Key>ckpt/a&amp;b.czr</Key><UploadId>id-1</UploadId></Upload>\
            <Upload><Key>ckpt/a.czr</Key><UploadId>id-2</UploadId><Initiated>x</Initiated></Upload>\
            </ListMultipartUploadsResult>";
        assert_eq!(
            super::uploads(xml),
            vec![("ckpt/a&b.czr".to_string(), "id-1".to_string()), ("ckpt/a.czr".to_string(), "id-2".to_string())]
        );
        assert!(super::uploads("<Error><Code>AccessDenied</Code></Error>").is_empty());
    }
}
