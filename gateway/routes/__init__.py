"""HTTP routes: the OpenAI surface (`openai`) and the operator's surface (`admin`)."""
