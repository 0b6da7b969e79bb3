"""The dashboard playground as the browser tests watch it."""

from __future__ import annotations

from playwright.async_api import Page


async def watch_replies(page: Page) -> None:
    """From now on the page keeps each text the playground's reply shows, in
    ``window.__replies`` (a reply streamed delta by delta shows several)."""
    await page.evaluate(
        """() => {
          window.__replies = [];
          new MutationObserver(() => {
            const reply = document.querySelector('#chat-log .msg.assistant .text');
            if (reply) window.__replies.push(reply.textContent);
          }).observe(document.getElementById('chat-log'),
                     { childList: true, characterData: true, subtree: true });
        }"""
    )
