// dgr's face of llama.cpp's chat code (common/chat in the pinned tree): a model's chat template
// rendered with tools, tool choice and reasoning as llama-server renders it, and the model's
// output parsed back into content, reasoning and tool calls by the same parsers.
//
// Every call takes and returns JSON text, so the binding needs no C++ type of llama.cpp's.
// Errors are C++ exceptions: std::invalid_argument for a bad request, std::runtime_error for a
// template that fails (the binding maps them to Python's ValueError and RuntimeError).
#pragma once

#include <memory>
#include <string>
#include <vector>

namespace dgr {

class ChatTemplate {
 public:
    // `source`: the Jinja text (a GGUF's tokenizer.chat_template); `tool_use`: the template the
    // model names for tool use ("" when none). `bos`/`eos`: the special tokens' text;
    // `add_bos`/`add_eos`: whether tokenizing adds them (a BOS/EOS the template writes is then
    // cut off the prompt, as llama-server does).
    ChatTemplate(const std::string & source, const std::string & tool_use, const std::string & bos,
                 const std::string & eos, bool add_bos, bool add_eos);
    ~ChatTemplate();
    ChatTemplate(const ChatTemplate &) = delete;
    ChatTemplate & operator=(const ChatTemplate &) = delete;

    // request: {"messages", "tools", "tool_choice" ("auto"|"none"|"required"),
    // "parallel_tool_calls", "json_schema", "grammar", "add_generation_prompt",
    // "reasoning_format", "enable_thinking", "chat_template_kwargs"}.
    // Returns {"prompt", "format", "format_name", "grammar", "grammar_lazy", "grammar_triggers":
    // [{"type", "value", "token"}], "preserved_tokens", "additional_stops", "generation_prompt",
    // "parser", "supports_thinking", "thinking_start_tag", "thinking_end_tags"}.
    std::string apply(const std::string & request_json) const;
    // the template's capabilities as llama.cpp reads them: {"supports_tools": true, ...}
    std::string caps() const;

 private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

// One reply's parser: the text generated so far, parsed after each piece as llama-server does.
class ChatParser {
 public:
    // params: {"format", "reasoning_format", "generation_prompt", "parser", "parse_tool_calls",
    // "reasoning_in_content"} (the first four from ChatTemplate::apply's answer).
    explicit ChatParser(const std::string & params_json);
    ~ChatParser();
    ChatParser(const ChatParser &) = delete;
    ChatParser & operator=(const ChatParser &) = delete;

    // Append `text` and parse all the text so far (`partial`: more may come). Returns
    // {"message": {"content", "reasoning_content", "tool_calls": [{"id", "name", "arguments"}]},
    //  "diffs": [{"content_delta", "reasoning_content_delta", "tool_call_index",
    //             "tool_call": {"id", "name", "arguments"}}]}: the message and what changed since
    // the last call. A tool call's id is made once ("call_" and 24 random characters) and kept.
    std::string update(const std::string & text, bool partial);

 private:
    struct Impl;
    std::unique_ptr<Impl> impl_;
};

}  // namespace dgr
